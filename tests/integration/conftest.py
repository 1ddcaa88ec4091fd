"""The integration tests use the session's default application (``embeddings_app``, in tests/conftest.py)."""
