import sys; sys.path.insert(0,'tests')
import numpy as np, model_builders as mb, onnx
from onnx import helper, numpy_helper, TensorProto
from pathlib import Path
rng=np.random.default_rng(0)
# 256 MiB embedding table (65536 x 1024 fp32) + 128 MiB of MatMul weights (8 x 1024x4096)
table = rng.standard_normal((65536,1024),dtype=np.float32)
inits=[numpy_helper.from_array(table,"table")]; del table
nodes=[helper.make_node("Gather",["table","ids"],["h0"])]
cur="h0"
for i in range(8):
    k,n = (1024,4096) if i%2==0 else (4096,1024)
    inits.append(numpy_helper.from_array(rng.standard_normal((k,n),dtype=np.float32)/np.float32(32),f"W{i}"))
    nodes.append(helper.make_node("MatMul",[cur,f"W{i}"],[f"h{i+1}"])); cur=f"h{i+1}"
g=helper.make_graph(nodes,"big",[helper.make_tensor_value_info("ids",TensorProto.INT64,[1,8])],[helper.make_tensor_value_info(cur,TensorProto.FLOAT,[1,8,1024])],inits)
m=mb.make_model(g)
mb.save(m, Path("big/emb.onnx"))
mb.save(m, Path("big/ext/ext.onnx"), external=True)
