"""How fast the card reads a Q4_K weight in the access patterns a quantized matmul can use,
loads only (no arithmetic): what bounds ``native/gguf_mma.cu`` at one row (benchmark only).

Patterns, over random Q4_K blocks of the 8B and 27B layer shapes, several copies rotated so that
L2 holds none between calls: ``cur``, ``gguf_mma``'s (a warp reads 8 rows, each lane 16 bytes of
its row's super-block header and 2 x 16 of its quants, ``depth`` super-blocks in flight in
registers); ``staged``, the same warp's rows copied by cp.async into shared memory, ``S``
super-blocks of every row a stage and ``P`` stages in flight. Each at K splits 1, the default and
twice it, with the blocks a multiprocessor holds capped at 5 (what ``gguf_mma``'s registers allow)
or not; last, the real ``gguf_mma`` at one row. Prints µs and GB/s per call.

Usage: python3 scripts/gpu_read_patterns.py
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf import GGMLQuantizationType as Q
from gpu_quant_libraries import random_blocks
from torch.utils.cpp_extension import load_inline

from native import gguf_mma

SRC = r'''
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cstdint>
__device__ __forceinline__ uint4 ld(const uint8_t* p){ return __ldg(reinterpret_cast<const uint4*>(p)); }
template<int D>
__global__ void cur(const uint8_t* w, uint32_t* out, int N, long row_bytes, int SB, int splits){
  int lane=threadIdx.x&31, warp=threadIdx.x>>5, g=lane>>2, c=lane&3;
  int n0=(blockIdx.x*4+warp)*8; int b0=SB*blockIdx.y/splits, b1=SB*(blockIdx.y+1)/splits;
  const uint8_t* row = w + (long)min(n0+g,N-1)*row_bytes;
  uint4 b[D][3]; uint32_t acc=0;
  #pragma unroll
  for(int d=0; d<D; ++d) if(b0+d<b1){ const uint8_t* p=row+(b0+d)*144; b[d][0]=ld(p); b[d][1]=ld(p+16+16*c); b[d][2]=ld(p+80+16*c);}
  for(int sb=b0; sb<b1; sb+=D){
    #pragma unroll
    for(int d=0; d<D; ++d){ if(sb+d<b1){ acc ^= b[d][0].x ^ b[d][1].y*3 ^ b[d][2].z*5 ^ b[d][1].w ^ b[d][2].x;
      int nx=sb+d+D; if(nx<b1){ const uint8_t* p=row+(long)nx*144; b[d][0]=ld(p); b[d][1]=ld(p+16+16*c); b[d][2]=ld(p+80+16*c);} } }
  }
  out[(blockIdx.y*gridDim.x+blockIdx.x)*blockDim.x+threadIdx.x]=acc;
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src){ asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src)); }
__device__ __forceinline__ void commit(){ asm volatile("cp.async.commit_group;"); }
template<int N> __device__ __forceinline__ void wait(){ asm volatile("cp.async.wait_group %0;" :: "n"(N)); }
// per-warp stages: S super-blocks of the warp's 8 rows, P stages in flight
template<int S, int P>
__global__ void staged(const uint8_t* w, uint32_t* out, int N, long row_bytes, int SB, int splits){
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int CH = S*144, ST = 8*CH, PIECES = ST/16;
  int lane=threadIdx.x&31, warp=threadIdx.x>>5, g=lane>>2, c=lane&3;
  int n0=(blockIdx.x*4+warp)*8; int b0=SB*blockIdx.y/splits, b1=SB*(blockIdx.y+1)/splits;
  uint8_t* mine = smem + warp*P*ST;
  uint32_t mine_s = (uint32_t)__cvta_generic_to_shared(mine);
  int steps = (b1-b0+S-1)/S;
  auto issue=[&](int st){ if(st<steps){ int sb=b0+st*S; int nsb=min(S,b1-sb);
      for(int p=lane; p<PIECES; p+=32){ int r=p/(CH/16), q=p%(CH/16); if(q*16 < nsb*144){
        cp16(mine_s + (st%P)*ST + r*CH + q*16, w + (long)min(n0+r,N-1)*row_bytes + (long)sb*144 + q*16);} } }
    commit(); };
  #pragma unroll
  for(int st=0; st<P-1; ++st) issue(st);
  uint32_t acc=0;
  for(int st=0; st<steps; ++st){
    issue(st+P-1);
    wait<P-1>(); __syncwarp();
    const uint8_t* base = mine + (st%P)*ST + g*CH;
    int nsb=min(S,b1-(b0+st*S));
    #pragma unroll
    for(int j=0;j<S;++j) if(j<nsb){ const uint8_t* p=base+j*144;
      uint4 h=*reinterpret_cast<const uint4*>(p), q0=*reinterpret_cast<const uint4*>(p+16+16*c), q1=*reinterpret_cast<const uint4*>(p+80+16*c);
      acc ^= h.x ^ q0.y*3 ^ q1.z*5 ^ q0.w ^ q1.x; }
    __syncwarp();
  }
  out[(blockIdx.y*gridDim.x+blockIdx.x)*blockDim.x+threadIdx.x]=acc;
}
void run(torch::Tensor w, torch::Tensor out, int64_t N, int64_t SB, int64_t splits, int64_t kind, int64_t a, int64_t b, int64_t max_blocks){
  auto s=at::cuda::getCurrentCUDAStream(); dim3 grid((N+31)/32, splits);
  long rb=w.stride(0); const uint8_t* p=w.data_ptr<uint8_t>(); uint32_t* o=(uint32_t*)out.data_ptr();
  int pad = max_blocks ? 227*1024/max_blocks - 1024 : 0;
  if(kind==0){
    #define C(D) { auto k=cur<D>; int sm=pad; if(sm) cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sm); k<<<grid,128,sm,s>>>(p,o,N,rb,SB,splits);}
    if(a==1) C(1) else if(a==2) C(2) else C(4)
  } else {
    #define G(S,P) { auto k=staged<S,P>; int sm=max(pad, 4*P*8*S*144); cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sm); k<<<grid,128,sm,s>>>(p,o,N,rb,SB,splits);}
    if(a==1&&b==4) G(1,4) else if(a==1&&b==8) G(1,8) else if(a==2&&b==3) G(2,3) else if(a==2&&b==4) G(2,4) else if(a==2&&b==6) G(2,6) else if(a==4&&b==3) G(4,3) else G(4,2)
  }
}
'''
CPP = "void run(torch::Tensor w, torch::Tensor out, int64_t N, int64_t SB, int64_t splits, int64_t kind, int64_t a, int64_t b, int64_t max_blocks);"
def timed(fns, reps=3):
    """Microseconds a call, each of ``fns`` (one per weight copy) replayed in a CUDA graph, best of 5."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / (reps * len(fns)))
    return best * 1e6


SHAPES = {"27b.gate_up": (34816, 5120), "27b.down": (5120, 17408), "27b.attn_qkv": (10240, 5120), "8b.gate_up": (24576, 4096), "8b.qkv": (6144, 4096)}


def main() -> None:
    ext = load_inline("read_patterns", CPP, cuda_sources=SRC, functions=["run"], extra_cuda_cflags=["-O3", "-std=c++17"], verbose=False)
    dev = torch.device("cuda")
    out = torch.empty(1 << 24, dtype=torch.int32, device=dev)
    for name, (n, k) in SHAPES.items():
        ws = [random_blocks(Q.Q4_K, n, k, dev) for _ in range(max(2, -(-400_000_000 // (n * k * 144 // 256))))]
        nbytes, sb = ws[0].numel(), k // 256
        default = gguf_mma.default_splits(-(-n // 32), sb, 132)
        res = []
        for splits in sorted({1, default, 2 * default}):
            for mb in (5, 0):
                for d in (1, 2, 4):
                    res.append((f"splits {splits} cur depth {d} blocks/SM<={mb or 'any'}",
                                timed([lambda w=w: ext.run(w, out, n, sb, splits, 0, d, 0, mb) for w in ws])))
                for stage, stages in ((1, 4), (1, 8), (2, 3), (2, 4), (2, 6), (4, 2), (4, 3)):
                    res.append((f"splits {splits} staged S={stage} P={stages} blocks/SM<={mb or 'any'}",
                                timed([lambda w=w: ext.run(w, out, n, sb, splits, 1, stage, stages, mb) for w in ws])))
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        res.append((f"gguf_mma M=1 (real, splits {default})", timed([lambda w=w: gguf_mma.matmul(x, w, Q.Q4_K, n) for w in ws])))
        print(f"== {name} N={n} K={k} {nbytes / 1e6:.1f} MB, default splits {default}")
        for label, us in res:
            print(f"  {label:48s} {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s")


if __name__ == "__main__":
    main()
