#!/usr/bin/env python3
"""LM-head screening experiment behind docs/perf.md ("The LM head on the CPU: screening").

Step 1 (exp.py): transformers runs the default GGUF on the Vim manual (/tmp/vim-manual.txt, two
2048-token windows), keeps the final-norm hidden states, and compares requantized heads.
Step 2 (exp4.py): Q8_0 high nibbles rank the vocabulary; the top k are recomputed exactly.
Step 3 (session 5): the CPU's screening copy (kernels/screen_copy.rs: columns centred and
divided by their mean |w - mu|, 4-bit codes, one integer scale 0..63 per 64 weights times a row
scale; activations times that mean, bytes with one scale per token, x.mu added exactly) ranks;
the top k are exact; the rest keep the copy's logits.
Run: python3 scripts/lm_head_screening.py 2   (needs torch, transformers, gguf; ~25 min)."""

# ---- step 1 ----
import os
import sys
import time

import gguf
import numpy as np
import torch

from gguf import quants
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(1)
d=os.path.expanduser("~/.cache/markbase/models"); name="gemma-3-270m-q4_k_m.gguf"
tok=AutoTokenizer.from_pretrained(d,gguf_file=name)
model=AutoModelForCausalLM.from_pretrained(d,gguf_file=name,dtype=torch.float32)
text=open('/tmp/vim-manual.txt').read()
ids=tok(text)['input_ids']
print('tokens',len(ids))
W=int(sys.argv[1]) if len(sys.argv)>1 else 2
hs=[];tg=[]
cap=[]
h=model.model.norm.register_forward_hook(lambda m,i,o: cap.append(o.detach()))
for w in range(W):
    chunk=ids[1+w*2047:1+(w+1)*2047]
    inp=torch.tensor([[tok.bos_token_id]+chunk])
    with torch.no_grad(): model.model(inp)
    hs.append(cap[-1][0,:-1]); tg.append(torch.tensor(chunk))
H=torch.cat(hs); T=torch.cat(tg)
# reference embedding from the GGUF itself
r=gguf.GGUFReader(os.path.join(d,name))
t=[t for t in r.tensors if t.name=='token_embd.weight'][0]
print(t.tensor_type.name)
E8=quants.dequantize(t.data, t.tensor_type).astype(np.float32)
print(E8.shape)
def nll(E):
    E=torch.from_numpy(E)
    tot=0.0
    for i in range(0,H.shape[0],512):
        L=H[i:i+512]@E.T
        tot+=(torch.logsumexp(L,1)-L.gather(1,T[i:i+512,None])[:,0]).sum().item()
    return tot/H.shape[0]
base=nll(E8); print('Q8_0 ref nll %.5f ppl %.4f'%(base,np.exp(base)))
for q in ['Q4_0','Q4_1','Q5_0','Q5_1']:
    qt=getattr(gguf.GGMLQuantizationType,q)
    t0=time.time(); Eq=quants.dequantize(quants.quantize(E8,qt),qt).astype(np.float32)
    n=nll(Eq); print('%s nll %.5f ppl %.4f  ppl change %+.3f%%  (%.0fs)'%(q,n,np.exp(n),(np.exp(n-base)-1)*100,time.time()-t0),flush=True)

# ---- step 2 (uses the tensors step 1 saved) ----
H, T = H[:2048], T[:2048]
E8 = torch.from_numpy(E8)
r=gguf.GGUFReader(os.path.expanduser('~/.cache/markbase/models/gemma-3-270m-q4_k_m.gguf'))
t=[t for t in r.tensors if t.name=='token_embd.weight'][0]
raw=np.asarray(t.data).reshape(-1,34)
dd=raw[:,:2].copy().view(np.float16).astype(np.float32)
q=raw[:,2:].copy().view(np.int8).astype(np.int32)
hi=q>>4
Ec=torch.from_numpy(((16*hi+7.5)*dd).astype(np.float32).reshape(E8.shape))
print('coarse rel rmse %.4f'%(((E8-Ec)**2).mean()/(E8**2).mean()).sqrt().item(),flush=True)
def run(Eq,K):
    tot=0.0; inK=0
    for i in range(0,H.shape[0],256):
        h=H[i:i+256]; tt=T[i:i+256]
        L=h@Eq.T
        if K:
            idx=L.topk(K,dim=1).indices
            ex=torch.einsum('bd,bkd->bk',h,E8[idx])
            L.scatter_(1,idx,ex); inK+=(idx==tt[:,None]).any(1).sum().item()
        tot+=(torch.logsumexp(L,1)-L.gather(1,tt[:,None])[:,0]).sum().item()
    return tot/H.shape[0], inK/H.shape[0]
base,_=run(E8,0); print('ref ppl %.4f'%np.exp(base),flush=True)
for K in [0,256,1024,4096]:
    n,f=run(Ec,K); print('split-hi K=%d ppl change %+.3f%% target-in-K %.3f'%(K,(np.exp(n-base)-1)*100,f),flush=True)

# ---- step 3: the CPU's screening copy (4-bit codes, integer chunk scales) ----
mu=E8.mean(0); Ez=E8-mu
beta=Ez.abs().mean(0)
Z=(Ez/beta).reshape(E8.shape[0],-1,64)
step=Z.abs().amax(2,keepdim=True)/7.5
top=step.amax(1,keepdim=True)
step=torch.ceil(step/top*63)*top/63
Ec=(torch.clamp(torch.round(Z/step.clamp(min=1e-30)),-8,7)*step).reshape(E8.shape)*beta
def coarse(h):
    g=h*beta; sc=g.abs().amax(1,keepdim=True)/127
    return (torch.round(g/sc)*sc/beta)@Ec.T+(h@mu)[:,None]
for K in [4096,8192]:
    tot=0.0; base=0.0; worst=0
    for i in range(0,H.shape[0],64):
        h=H[i:i+64]; tt=T[i:i+64]
        Lx=h@E8.T; L=coarse(h)
        t8=L.gather(1,Lx.topk(8,dim=1).indices)
        worst=max(worst,(L[:,None,:]>t8[:,:,None]).sum(2).max().item())
        idx=L.topk(K,dim=1).indices
        L.scatter_(1,idx,Lx.gather(1,idx))
        tot+=(torch.logsumexp(L,1)-L.gather(1,tt[:,None])[:,0]).sum().item()
        base+=(torch.logsumexp(Lx,1)-Lx.gather(1,tt[:,None])[:,0]).sum().item()
    n=H.shape[0]
    print('chunk-scaled 4-bit K=%d ppl change %+.3f%%; worst copy rank of a true top-8 token %d'%(K,(np.exp((tot-base)/n)-1)*100,worst),flush=True)
