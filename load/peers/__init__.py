"""Peer embedding servers that ``python -m load.bench peers`` measures beside this service: their virtualenvs and
launch (``launch``), and the small apps written for those that need one (``fastapi_plain``, ``mosec_app``,
``litserve_app``; ``infinity_onnx`` exports the ONNX graph infinity's optimum engine serves)."""
