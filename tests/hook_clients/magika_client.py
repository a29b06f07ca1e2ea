"""An unmodified magika (PyPI) run: content types of a few in-memory samples, as JSON on stdout."""
import json

from magika import Magika

SAMPLES = {
    "python": b"import os\n\ndef main():\n    print(os.getcwd())\n\nif __name__ == '__main__':\n    main()\n" * 4,
    "json": json.dumps({"name": "ortmem", "values": list(range(40)), "nested": {"a": [1, 2, 3]}}).encode(),
    "html": b"<!DOCTYPE html><html><head><title>t</title></head><body><p>hello</p><a href='x'>y</a></body></html>\n" * 3,
    "c": b"#include <stdio.h>\nint main(void) {\n  printf(\"%d\\n\", 42);\n  return 0;\n}\n" * 3,
}

m = Magika()
out = {}
for name, data in SAMPLES.items():
    r = m.identify_bytes(data)
    out[name] = {"label": str(r.output.label), "score": float(r.score)}
print(json.dumps(out, sort_keys=True))
