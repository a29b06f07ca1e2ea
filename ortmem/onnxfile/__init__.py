"""Reading .onnx files without copying their weights: the wire walk, the scan of what a file needs,
the loader and its mapped weights (docs/architecture.md)."""

#: The op type every conversion starts from, as its bytes appear in a file (a byte search's needle).
DEQUANTIZE = b"DequantizeLinear"
