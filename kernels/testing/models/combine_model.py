#!/usr/bin/env python3
"""Hand-written host model of CombineKernel (kernels/verify_kernel.cuh): the
per-warp online (max, sum, o) over round-robin splits and the shared-memory
merge, against a direct log-sum-exp merge, for split counts 2..100 with -inf
LSEs. Run: python3 kernels/testing/models/combine_model.py; prints the
largest error (~1e-14) and -inf for an all -inf row.
"""
import math, random
NEG=-math.inf
rnd=random.Random(0)
def ex(x): return 0.0 if x==NEG else math.exp(x)
def combine(lse,o):
    S=len(lse); W=8; U=4
    sacc=[[None]*128 for _ in range(W)]; smax=[NEG]*W; ssum=[0.0]*W
    for w in range(W):
        m=NEG; l=0.0; acc=[[[0.0]*4 for k in range(4)] for lane in range(32)]
        for s0 in range(w,S,W*U):
            for u in range(U):
                s=s0+u*W; valid=s<S
                lv=lse[s] if valid else NEG
                mn=max(m,lv)
                if mn==NEG: continue
                sc=ex(m-mn) if m!=NEG else 0.0; wt=ex(lv-mn) if lv!=NEG else 0.0
                l=l*sc+wt
                for lane in range(32):
                    for k in range(4):
                        base=lane*4+k*128
                        for c in range(4):
                            ov=o[s][base+c] if valid else 0.0
                            acc[lane][k][c]=acc[lane][k][c]*sc+wt*ov
                m=mn
        for lane in range(32):
            for k in range(4): sacc[w][lane+k*32]=acc[lane][k]
        smax[w]=m; ssum[w]=l
    flat=[[x for f4 in sacc[w] for x in f4] for w in range(W)]
    mx=max(smax); ref=0.0 if mx==NEG else mx
    out=[0.0]*512; tot=0.0
    for t in range(256):
        col=2*t
        for w in range(W):
            e=ex(smax[w]-ref) if smax[w]!=NEG else 0.0
            if t==0: tot+=e*ssum[w]
            out[col]+=e*flat[w][2*t]; out[col+1]+=e*flat[w][2*t+1]
    inv=1/tot if tot>0 else 0
    return [x*inv for x in out], (ref+math.log(tot) if tot>0 else NEG)
worst=0
for S in [2,3,7,8,9,31,32,33,65,100]:
    lse=[rnd.gauss(0,5) if rnd.random()>0.3 else NEG for _ in range(S)]
    o=[[rnd.gauss(0,1) for _ in range(512)] for _ in range(S)]
    out,l=combine(lse,o)
    fin=[x for x in lse if x!=NEG]
    if not fin: print(S,"all -inf",l,max(map(abs,out))); continue
    M=max(fin); w=[ex(x-M) if x!=NEG else 0 for x in lse]; W_=sum(w)
    ref=[sum(w[s]*o[s][c] for s in range(S))/W_ for c in range(512)]
    worst=max(worst,max(abs(a-b) for a,b in zip(out,ref)),abs(l-(M+math.log(W_))))
print("max err",worst)
print(combine([NEG]*5,[[1.0]*512]*5)[1])
