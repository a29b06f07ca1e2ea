"""ortmem: own the memory lifecycle of ONNX model weights around ONNX Runtime."""
from .errors import OrtmemError

__all__ = ["OrtmemError"]
__version__ = "0.1.0"
