#!/usr/bin/env python3
"""Hand-written host model of the work plan (kernels/verify_kernel.cuh):
PlanKernel (one thread per request, block scans) against PlanInWarp (one
warp, lane = request) on random batches of 1..32 with padding requests,
checking identical work lists and that every (request, row tile) covers its
KV range exactly once. Run: python3 kernels/testing/models/plan_model.py
(~3 min); prints "mismatches 0".
"""
import random
BM=32; BN=32; NOSPLIT=(1<<30)//BN
cd=lambda a,b:(a+b-1)//b
def shapes(batch, pre, dr, H, lanes):
    out=[]
    for b in range(lanes):
        if b<batch:
            n=dr[b]; kv=pre[b]+n; rt=cd(n*H,BM); ti=cd(kv,BN) if n>0 else 0
        else: n=kv=rt=ti=0
        out.append((n,kv,rt,ti))
    return out
def chunk(sh, T, minc):
    cost=sum(r*t for _,_,r,t in sh); R=sum(r for _,_,r,_ in sh)
    cl=lambda c: min(max(c,minc),NOSPLIT)
    tight=safe=NOSPLIT
    if R<T:
        sp=T-R; safe=cl(cd(cost,sp)); tight=cl(cd(cost,T))
    ti=sum(r*cd(t,tight) if t>0 else 0 for _,_,r,t in sh)
    return tight if ti<=T else safe
def mk(r,local,rt,kv,c):
    tiles=cd(kv,BN); sp=cd(tiles,c); s=local//rt
    return (r, local%rt, s, (s*tiles//sp)*BN, min(kv,((s+1)*tiles//sp)*BN))
def plan(batch,pre,dr,H,T,minc,maxw,lanes,find_request):
    # What both paths share (the device code shares it through helpers);
    # they differ in how many requests they scan and in the lookup of the
    # request that holds item w.
    sh=shapes(batch,pre,dr,H,lanes); c=chunk(sh,T,minc)
    splits=[cd(t,c) if t>0 else 0 for _,_,_,t in sh]
    base=[];acc=0
    for (n,kv,rt,t),s in zip(sh,splits): base.append(acc); acc+=rt*s
    tot=acc; work=[]
    for w in range(maxw):
        if w<tot:
            r=find_request(base,batch,w)
            work.append(mk(r,w-base[r],sh[r][2],sh[r][1],c))
        else: work.append(None)
    return tot,work,splits[:batch],base[:batch]
def kernel_lookup(base,batch,w):  # PlanKernel: binary search over the bases
    lo,hi=0,batch-1
    while lo<hi:
        mid=(lo+hi+1)>>1
        if base[mid]<=w: lo=mid
        else: hi=mid-1
    return lo
def warp_lookup(base,batch,w):  # PlanInWarp: ballot of lanes at or below w, highest set bit
    bal=sum(1<<l for l in range(32) if l<batch and base[l]<=w)
    return bal.bit_length()-1
def plan_kernel(batch,pre,dr,H,T,minc,maxw):
    return plan(batch,pre,dr,H,T,minc,maxw,1024,kernel_lookup)
def plan_warp(batch,pre,dr,H,T,minc,maxw):
    return plan(batch,pre,dr,H,T,minc,maxw,32,warp_lookup)
rnd=random.Random(1); bad=0
for it in range(20000):
    batch=rnd.randint(1,32); H=rnd.choice([1,2,16,128]); T=rnd.choice([132,264,16,1])
    pre=[rnd.choice([0,1,31,32,33,4096,70000,rnd.randint(0,100000)]) for _ in range(batch)]
    dr=[rnd.choice([0,0,1,2,7,64,rnd.randint(0,64)]) for _ in range(batch)]
    if rnd.random()<0.3:
        k=rnd.randint(0,batch); dr[k:]=[0]*(batch-k)
    maxrt=cd(max(max(dr),1)*H,BM); maxw=max(T,batch*maxrt)
    minc=rnd.choice([1,2,4])
    a=plan_kernel(batch,pre,dr,H,T,minc,maxw); b=plan_warp(batch,pre,dr,H,T,minc,maxw)
    if a!=b: bad+=1; print(batch,pre,dr); break
    # coverage check: each (request,row_tile) covers KV exactly
    tot,work,splits,base=a
    assert tot<=maxw
    assert not any(s>1 for s in splits) or tot<=T, (batch,T,tot)
    for bb in range(batch):
        if dr[bb]==0: continue
        kv=pre[bb]+dr[bb]; rt=cd(dr[bb]*H,BM)
        for r in range(rt):
            segs=sorted((x[3],x[4]) for x in work[:tot] if x and x[0]==bb and x[1]==r)
            assert segs[0][0]==0 and segs[-1][1]==kv and all(segs[i][1]==segs[i+1][0] for i in range(len(segs)-1)) and all(e>s for s,e in segs)
print("mismatches", bad)
import sys
sys.exit(1 if bad else 0)
