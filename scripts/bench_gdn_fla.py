"""fla's gated-delta kernels on the shapes of examples/gdn_bench.rs (Qwen3.5-35B-A3B: 16 q/k
heads, 32 v heads, d = 128, f32 state), timed by triton.testing.do_bench (median), in the same
device call as the tern benchmark. State layout V-first ([V][K], tern's transposed layout), q/k
L2-normalised in the kernel, as tern's fused path does.

    python3 scripts/bench_gdn_fla.py [decode] [prefill] [bf16] [f32]

Sections and prefill dtypes to run; with none named, all of them."""
import sys

import torch
import triton
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

torch.manual_seed(0)
dev = "cuda"
H, HV, D = 16, 32, 128


def ops(B, T, dtype):
    q = torch.rand(B, T, H, D, device=dev, dtype=dtype) * 2 - 1
    k = torch.rand(B, T, H, D, device=dev, dtype=dtype) * 2 - 1
    v = torch.rand(B, T, HV, D, device=dev, dtype=dtype) * 2 - 1
    g = -(torch.rand(B, T, HV, device=dev, dtype=torch.float32) * 0.999 + 0.001)
    beta = torch.rand(B, T, HV, device=dev, dtype=dtype)
    return q, k, v, g.to(dtype), beta


args = set(sys.argv[1:])
sections = args & {"decode", "prefill"} or {"decode", "prefill"}
dtypes = [d for n, d in (("bf16", torch.bfloat16), ("f32", torch.float32)) if n in args or not args & {"bf16", "f32"}]

if "decode" in sections:
    print("fla decode (fused_recurrent_gated_delta_rule, one token, state f32 V-first)")
for B in (1, 16, 64, 256) if "decode" in sections else ():
    q, k, v, g, beta = ops(B, 1, torch.float32)
    # Rotate state pools past the L2, as the tern benchmark does.
    rot = max(1, min(64, (1024 << 20) // (B * HV * D * D * 4)))
    h0 = [torch.rand(B, HV, D, D, device=dev) - 0.5 for _ in range(rot)]
    i = [0]

    def step():
        s = h0[i[0] % rot]
        i[0] += 1
        return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, state_v_first=True)

    ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    print(f"RESULT fla_decode batch={B} us={ms * 1e3:.3f}")
    # Its kernel without the host: 50 steps (rotating the pools as above) captured in one CUDA
    # graph, replayed, the time over 50 (tern's gdn_bench times 50 launches back to back).
    inner = 50

    def graph_row(name, one):
        """Times `inner` calls of `one` recorded in a graph, as row `name`; reports and goes on
        where the capture fails (the plain timing stands)."""
        i[0] = 0
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(inner):
                    one()
            ms = triton.testing.do_bench(graph.replay, warmup=5, rep=100, return_mode="median")
            print(f"RESULT fla_decode_{name} batch={B} us={ms * 1e3 / inner:.3f}")
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"fla decode batch={B}: no CUDA graph for {name} ({type(e).__name__}: {e})")

    graph_row("graph", step)
    # The same with every step's final state kept (`graph_kept`): without that, the graph's
    # allocator may give each step's new final-state tensor the memory of the one before, so the
    # steps overwrite one buffer that stays in the L2, where a decode must keep each new state
    # (tern writes its states in place, rotating through the pools like the reads).
    kept = []
    graph_row("graph_kept", lambda: kept.append(step()[1]))
    del kept
    # The same on one state, not rotated (tern's `graph_l2` row): where the state fits in the L2
    # its reads come from there. (fla writes each step's final state to a new tensor, which the
    # graph's allocator may give the same memory every step, its writes then staying in the L2
    # in both forms; tern writes its states in place.)
    rot_kept, rot = rot, 1
    graph_row("graph_l2", step)
    rot = rot_kept

if "prefill" in sections:
    print("fla prefill (chunk_gated_delta_rule, one sequence, state f32 V-first)")
for T in (2048, 8192, 32768) if "prefill" in sections else ():
    for dtype in dtypes:
        q, k, v, g, beta = ops(1, T, dtype)
        h0 = torch.rand(1, HV, D, D, device=dev) - 0.5
        f = lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, state_v_first=True)
        ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
        name = str(dtype).split('.')[-1]
        print(f"RESULT fla_prefill tokens={T} dtype={name} ms={ms:.4f}")
        # The same call replayed from a CUDA graph: fla's kernels without its host-side cost.
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                f()
            ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
            print(f"RESULT fla_prefill_graph tokens={T} dtype={name} ms={ms:.4f}")
        except Exception as e:  # noqa: BLE001 - report and go on: the plain timing stands
            print(f"fla prefill tokens={T} dtype={name}: no CUDA graph ({type(e).__name__}: {e})")
