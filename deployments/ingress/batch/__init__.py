"""OpenAI's Batch API on this service: ``store`` keeps files and batches on disk, ``lines`` reads and writes a batch
file's lines, ``runner`` runs each batch's lines through the models as LOW requests, ``routes`` serves
``/v1/files`` and ``/v1/batches``."""
