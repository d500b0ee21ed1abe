#!/usr/bin/env python3
"""Two-level LM-head screening experiment (docs/perf.md, "A 2-bit screening copy: data").

transformers runs the default GGUF on the Vim manual (/tmp/vim-manual.txt, two 2047-token
windows, 4 094 positions) and keeps the final-norm hidden states. A 2-bit copy of the head
(columns centred and divided by their mean |w - mu| as in kernels/screen_copy.rs; codes
{-1.5, -0.5, 0.5, 1.5} x an integer chunk scale 0..63 x a row scale) ranks the vocabulary with
byte activations; optionally its top N are re-ranked by the 4-bit copy (the CPU's screening
copy, emulated); the top 4 096 are exact. Reports the perplexity change against the exact
head, the worst 2-bit rank of a true top-8 token, and how often the exact argmax falls
outside the exact set.
Run: python3 scripts/lm_head_two_level.py   (needs torch, transformers, gguf; ~25 min on 2 cores).
"""
import os, sys, time
import gguf, numpy as np, torch
from gguf import quants
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(2)
d=os.path.expanduser("~/.cache/markbase/models"); name="gemma-3-270m-q4_k_m.gguf"
tok=AutoTokenizer.from_pretrained(d,gguf_file=name)
model=AutoModelForCausalLM.from_pretrained(d,gguf_file=name,dtype=torch.float32)
ids=tok(open('/tmp/vim-manual.txt').read())['input_ids']
cap=[]; model.model.norm.register_forward_hook(lambda m,i,o: cap.append(o.detach()))
hs=[];tg=[]
for w in range(2):
    chunk=ids[1+w*2047:1+(w+1)*2047]
    with torch.no_grad(): model.model(torch.tensor([[tok.bos_token_id]+chunk]))
    hs.append(cap[-1][0,:-1]); tg.append(torch.tensor(chunk))
H=torch.cat(hs); T=torch.cat(tg)
del model
r=gguf.GGUFReader(os.path.join(d,name))
t=[t for t in r.tensors if t.name=='token_embd.weight'][0]
E8=torch.from_numpy(quants.dequantize(t.data, t.tensor_type).astype(np.float32))
mu=E8.mean(0); Ez=E8-mu; beta=Ez.abs().mean(0)
Z=(Ez/beta).reshape(E8.shape[0],-1,64)
def copy(levels, chunk):
    Zc=Z.reshape(E8.shape[0],-1,chunk)
    half=levels/2
    step=Zc.abs().amax(2,keepdim=True)/(half if levels==4 else 7.5)
    top=step.amax(1,keepdim=True)
    step=torch.ceil(step/top*63)*top/63
    q=torch.clamp(torch.floor(Zc/step.clamp(min=1e-30)),-half,half-1)+0.5 if levels==4 else torch.clamp(torch.round(Zc/step.clamp(min=1e-30)),-8,7)
    return (q*step).reshape(E8.shape)*beta
E4=copy(16,64)
def scores(h,E):
    g=h*beta; sc=g.abs().amax(1,keepdim=True)/127
    return (torch.round(g/sc)*sc/beta)@E.T+(h@mu)[:,None]
print('positions',H.shape[0],flush=True)
for chunk in [32,16]:
    E2=copy(4,chunk)
    for N in [0,8192,16384,32768]:
        tot=0.0; base=0.0; worst=0; miss=0
        t0=time.time()
        for i in range(0,H.shape[0],64):
            h=H[i:i+64]; tt=T[i:i+64]
            Lx=h@E8.T; L=scores(h,E2)
            t8=L.gather(1,Lx.topk(8,dim=1).indices)
            worst=max(worst,(L[:,None,:]>t8[:,:,None]).sum(2).max().item())
            if N:
                cand=L.topk(N,dim=1).indices
                L4=scores(h,E4).gather(1,cand)
                L.scatter_(1,cand,L4)
                sel=cand.gather(1,L4.topk(4096,dim=1).indices)
            else:
                sel=L.topk(4096,dim=1).indices
            miss+=(Lx.argmax(1)[:,None]!=sel).all(1).sum().item()
            L.scatter_(1,sel,Lx.gather(1,sel))
            tot+=(torch.logsumexp(L,1)-L.gather(1,tt[:,None])[:,0]).sum().item()
            base+=(torch.logsumexp(Lx,1)-Lx.gather(1,tt[:,None])[:,0]).sum().item()
        n=H.shape[0]
        print('2-bit chunk %d, N=%d: ppl change %+.3f%%, worst 2-bit rank of a true top-8 token %d, exact argmax missed at %d positions (%.0fs)'%(chunk,N,(np.exp((tot-base)/n)-1)*100,worst,miss,time.time()-t0),flush=True)
