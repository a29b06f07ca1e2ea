import sys, time, os
import numpy as np, onnxruntime as ort, ortmem
def rss(): 
    d={l.split(':')[0]:int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(('VmRSS','VmHWM','RssAnon','RssFile'))}; return d
open('/proc/self/clear_refs','w').write('5'); b=rss()
t=time.perf_counter()
mode, p = sys.argv[1], sys.argv[2]
s = ort.InferenceSession(p) if mode=="ort" else ortmem.InferenceSession(p)
dt=time.perf_counter()-t; a=rss()
y=s.run(None,{"ids":np.arange(8,dtype=np.int64)[None]})[0]
print(f"{mode:7s} {os.path.basename(p):9s} peak+{(a['VmHWM']-b['VmRSS'])/1024:7.1f} MiB  steady+{(a['VmRSS']-b['VmRSS'])/1024:7.1f} anon+{(a['RssAnon']-b['RssAnon'])/1024:7.1f} init {dt:.2f}s sum {float(y.sum()):.6f}")
