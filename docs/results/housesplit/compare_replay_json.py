import json,sys
def strip(o):
    if isinstance(o,dict):
        return {k:strip(v) for k,v in o.items() if not any(t in k for t in ("scheduler_ms","plan_ms","gpu_ms","connector_ms","step_ms","scheduler_time_ratio","scheduler_seconds","wall_seconds"))}
    if isinstance(o,list): return [strip(x) for x in o]
    return o
a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2]))
sa,sb=strip(a),strip(b)
def diff(x,y,path=""):
    if type(x)!=type(y): print("TYPE",path); return 1
    if isinstance(x,dict):
        n=0
        for k in set(x)|set(y):
            if k not in x or k not in y: print("KEY",path+"/"+k); n+=1
            else: n+=diff(x[k],y[k],path+"/"+k)
        return n
    if isinstance(x,list):
        if len(x)!=len(y): print("LEN",path); return 1
        return sum(diff(p,q,f"{path}[{i}]") for i,(p,q) in enumerate(zip(x,y)))
    if x!=y: print("DIFF",path,x,y); return 1
    return 0
n=diff(sa,sb); print(sys.argv[1], "differences (timing keys excluded):", n)
