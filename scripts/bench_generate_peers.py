#!/usr/bin/env python3
"""Qwen3.5 CPU generation speed, tern beside llama.cpp, on the same GGUF file and thread count.

Runs `tern bench generate` and llama.cpp's `llama-bench` alternately (tern, llama.cpp, tern, ...)
for --rounds rounds, so that load from other processes on the machine falls on both alike, and
prints the medians over rounds: prefill tokens/s of a --prompt-tokens prompt, decode tokens/s of
--gen-tokens tokens (both peers decode from an empty context: llama-bench's tg test), their
ratios, and tern's fractions of the rooflines it measures in the same run (memory-read
bandwidth for decode, the f32 GEMM rate for prefill). --json writes every raw result too.

    python scripts/bench_generate_peers.py --model ~/.cache/tern/bench/qwen35-0.8b-bf16.gguf \\
        [--tern $CARGO_TARGET_DIR/release/tern] [--llama-bench ~/.cache/tern/llama.cpp-build-cpu/bin/llama-bench] \\
        [--prompt-tokens 512] [--gen-tokens 64] [--threads 2] [--rounds 5] [--json OUT.json]

llama-bench's prompt is random token ids too; its pp test runs the prompt as one batch (-b/-ub
default 2048/512, so a 512-token prompt is one ubatch), as tern's prefill does.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def run_tern(args):
    cmd = [args.tern, "bench", "generate", "--model", args.model, "--prompt-tokens", str(args.prompt_tokens),
           "--gen-tokens", str(args.gen_tokens), "--threads", str(args.threads), "--iters", str(args.tern_iters)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tern failed: {r.stderr.strip()}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_llama(args):
    cmd = [args.llama_bench, "-m", args.model, "-p", str(args.prompt_tokens), "-n", str(args.gen_tokens),
           "-t", str(args.threads), "-r", str(args.llama_reps), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed: {r.stderr.strip()[-2000:]}")
    res = json.loads(r.stdout)
    pp = next(x for x in res if x["n_prompt"] > 0 and x["n_gen"] == 0)
    tg = next(x for x in res if x["n_gen"] > 0 and x["n_prompt"] == 0)
    return {"prefill_tokens_per_s": pp["avg_ts"], "decode_tokens_per_s": tg["avg_ts"],
            "prefill_samples": pp.get("samples_ts"), "decode_samples": tg.get("samples_ts"),
            "build": {k: pp.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "type_k")}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tern", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target")),
                                                "release", "tern"))
    ap.add_argument("--llama-bench", default=os.path.expanduser("~/.cache/tern/llama.cpp-build-cpu/bin/llama-bench"))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tern-iters", type=int, default=1, help="timed repetitions inside one tern run")
    ap.add_argument("--llama-reps", type=int, default=1, help="llama-bench -r inside one llama-bench run")
    ap.add_argument("--json", help="write every raw result here")
    args = ap.parse_args()
    args.model = os.path.expanduser(args.model)

    terns, llamas = [], []
    for i in range(args.rounds):
        terns.append(run_tern(args))
        llamas.append(run_llama(args))
        t, l = terns[-1], llamas[-1]
        print(f"round {i + 1}/{args.rounds}: tern pp {t['prefill_tokens_per_s']:.1f} tg {t['decode_tokens_per_s']:.2f} | "
              f"llama.cpp pp {l['prefill_tokens_per_s']:.1f} tg {l['decode_tokens_per_s']:.2f}", file=sys.stderr, flush=True)

    med = lambda rows, k: statistics.median(r[k] for r in rows)
    tp, td = med(terns, "prefill_tokens_per_s"), med(terns, "decode_tokens_per_s")
    lp, ld = med(llamas, "prefill_tokens_per_s"), med(llamas, "decode_tokens_per_s")
    summary = {
        "model": args.model, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens, "rounds": args.rounds,
        "tern": {"prefill_tokens_per_s": tp, "decode_tokens_per_s": td,
                 "decode_tokens_per_s_mean": med(terns, "decode_tokens_per_s_mean"),
                 "read_bandwidth_gb_per_s": med(terns, "read_bandwidth_gb_per_s"),
                 "decode_bandwidth_fraction": med(terns, "decode_bandwidth_fraction"),
                 "gemm_gflops_per_s": med(terns, "gemm_gflops_per_s"),
                 "prefill_gemm_fraction": med(terns, "prefill_gemm_fraction"),
                 "decode_bytes_per_token": terns[0]["decode_bytes_per_token"],
                 "prefill_flops": terns[0]["prefill_flops"]},
        "llama_cpp": {"prefill_tokens_per_s": lp, "decode_tokens_per_s": ld, "build": llamas[0]["build"]},
        "ratio_prefill": tp / lp, "ratio_decode": td / ld,
    }
    # llama.cpp's fractions of the same rooflines, from tern's measurement of them.
    bw = summary["tern"]["read_bandwidth_gb_per_s"] * 1e9
    rate = summary["tern"]["gemm_gflops_per_s"] * 1e9
    summary["llama_cpp"]["decode_bandwidth_fraction"] = ld * summary["tern"]["decode_bytes_per_token"] / bw
    summary["llama_cpp"]["prefill_gemm_fraction"] = lp * summary["tern"]["prefill_flops"] / args.prompt_tokens / rate

    print(f"\n{'':24}{'tern':>12}{'llama.cpp':>12}{'ratio':>9}")
    print(f"{'prefill tokens/s':24}{tp:12.1f}{lp:12.1f}{tp / lp:9.2f}")
    print(f"{'decode tokens/s':24}{td:12.2f}{ld:12.2f}{td / ld:9.2f}")
    print(f"{'decode / read bandwidth':24}{summary['tern']['decode_bandwidth_fraction']:12.2f}"
          f"{summary['llama_cpp']['decode_bandwidth_fraction']:12.2f}")
    print(f"{'prefill / f32 GEMM rate':24}{summary['tern']['prefill_gemm_fraction']:12.2f}"
          f"{summary['llama_cpp']['prefill_gemm_fraction']:12.2f}")
    print(f"(read bandwidth {bw / 1e9:.1f} GB/s, f32 GEMM {rate / 1e9:.0f} GFLOP/s, medians of {args.rounds} rounds)")
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "tern": terns, "llama_cpp": llamas}, f, indent=1)


if __name__ == "__main__":
    main()
