//! Benchmark of the gated-delta CUDA kernels on Qwen3.5-35B-A3B shapes (16 q/k heads, 32 v
//! heads, d = 128, f32 state), printed as a table; the fla peer runs in
//! scripts/bench_gdn_fla.py on the same shapes in the same device call.
//!
//!   cargo run --release --example gdn_bench [decode] [prefill] [batch=N] [tokens=N]   (on a machine with an NVIDIA GPU)
//!
//! With no section named both run; `batch=N` limits decode to that batch, `tokens=N` prefill to
//! that prompt length (e.g. under a profiler).
//!
//! Decode: one token for B sequences, state bytes read + written per second against the copy
//! bandwidth measured first in the same run (1 GiB), beside a device copy of the step's own
//! bytes (which pays the same launch and ramp), for the default and every variant. The state pools rotate through more than the L2
//! holds, so repeated steps are not served from cache. Prefill: one layer's chunked prefill of
//! one sequence, with its error against the device's sequential scan (the oracle): the f32
//! mode (f32 and f64 accumulators) and the fast mode (tensor cores, bf16 operands), each also
//! timed without its sequential pass; the fast mode's time is set against the fewest bytes
//! the layer must move (q, k, v read and the output written once, f32) at the copy bandwidth.
//! The fast mode also runs with q, k, v and the output in bf16 (fla's interface), timed and
//! set against its own floor (those bytes in bf16). Each of the fast mode's two passes is also
//! set against the fewest bytes it must move in this design (`prefill_two_pass_floor`: its
//! operands for the state pass written to device memory and read back included).

use tern::cuda::{CudaSlice, Gpu};
use tern::kernels::gated_delta::cuda::{fast_operand_bytes, ChunkAccumulate, ScatterSums, CHUNK_STATE_ROWS, RECURRENCE_BLOCK_WARPS, RECURRENCE_BLOCK_WARP_CHOICES, RECURRENCE_VARIANTS, FusedGatesNorm, GatedDeltaCuda, GpuBf16DeltaRuleInputs, GpuDeltaRuleInputs, GpuSegments, GpuStates, Rows};
use tern::kernels::gated_delta::{DeltaRuleHeads, KeyHeadMap};
use tern::kernels::pack;
use tern::Result;

mod timing;
use timing::time_ms;

struct Lcg(u64);
impl Lcg {
    fn unit(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as u32) as f32 / (1u32 << 24) as f32
    }
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| lo + (hi - lo) * self.unit()).collect()
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let (mut d, mut r) = (0.0f64, 0.0f64);
    for (&a, &b) in got.iter().zip(want) {
        d += (a as f64 - b as f64).powi(2);
        r += (b as f64).powi(2);
    }
    (d / r).sqrt()
}

/// Raw per-token operands in the conv output's fused `[q | k | v]` rows, plus g and β.
struct Layer {
    qkv: tern::cuda::CudaSlice<f32>,
    g: tern::cuda::CudaSlice<f32>,
    beta: tern::cuda::CudaSlice<f32>,
}

fn layer(gpu: &Gpu, rng: &mut Lcg, heads: &DeltaRuleHeads, tokens: usize) -> Result<Layer> {
    let row = 2 * heads.n_k_heads * heads.d_k + heads.n_v_heads * heads.d_v;
    let qkv = rng.vec(tokens * row, -1.0, 1.0);
    // Decays like a trained layer's: exp(g) mostly in (0.37, 1); with `weak` on the command
    // line, those of slowly forgetting heads (exp(g) in (0.98, 0.9999)), which the state pass's
    // segments cannot start early (FastVariant::segments).
    let weak = std::env::args().any(|a| a == "weak");
    let (g_lo, g_hi) = if weak { (-0.02, -0.0001) } else { (-1.0, -0.001) };
    let g: Vec<f32> = rng.vec(tokens * heads.n_v_heads, g_lo, g_hi);
    let beta = rng.vec(tokens * heads.n_v_heads, 0.0, 1.0);
    Ok(Layer { qkv: gpu.upload(&qkv)?, g: gpu.upload(&g)?, beta: gpu.upload(&beta)? })
}

fn inputs<'a>(heads: &DeltaRuleHeads, l: &'a Layer) -> GpuDeltaRuleInputs<'a> {
    let qk = heads.n_k_heads * heads.d_k;
    let row = 2 * qk + heads.n_v_heads * heads.d_v;
    GpuDeltaRuleInputs {
        q: Rows { buf: &l.qkv, offset: 0, stride: row },
        k: Rows { buf: &l.qkv, offset: qk, stride: row },
        v: Rows { buf: &l.qkv, offset: 2 * qk, stride: row },
        g: &l.g,
        beta: &l.beta,
        normalize_qk: true,
        fused: None,
    }
}

fn main() -> Result<()> {
    let gpu = Gpu::new(0)?;
    let mut k = GatedDeltaCuda::new(gpu.clone())?;
    let heads = DeltaRuleHeads { n_k_heads: 16, n_v_heads: 32, d_k: 128, d_v: 128, key_head: KeyHeadMap::Grouped };
    println!("device: {} ({}, {} SMs)", gpu.name(), gpu.arch(), gpu.multiprocessors()?);
    let mut rng = Lcg(0x5eed);

    // Copy bandwidth: 1 GiB device-to-device, bytes read + written.
    let n = 1usize << 28;
    let src = gpu.upload(&rng.vec(n, -1.0, 1.0))?;
    let mut dst = gpu.zeros::<f32>(n)?;
    let copy_ms = time_ms(&gpu, 3, 20, |_| gpu.copy(&src, &mut dst))?;
    let copy_bw = 2.0 * 4.0 * n as f64 / (copy_ms * 1e-3);
    drop((src, dst));
    println!("copy: {:.3} ms for 2 x {} MiB -> {:.0} GB/s (read + written)", copy_ms, 4 * n >> 20, copy_bw / 1e9);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let section = |name: &str| args.is_empty() || args.iter().any(|a| a == name);
    if section("decode") {
        decode(&gpu, &mut k, &heads, &mut rng, copy_bw)?;
    }
    if section("prefill") {
        prefill(&gpu, &mut k, &heads, &mut rng, copy_bw)?;
    }
    Ok(())
}

/// Milliseconds of one decode step: the median run of `inner` steps, each on the next of the
/// rotating slot sets `segs`.
#[allow(clippy::too_many_arguments)]
fn steps_ms(gpu: &Gpu, k: &GatedDeltaCuda, heads: &DeltaRuleHeads, x: &GpuDeltaRuleInputs, segs: &[GpuSegments], pool: &mut CudaSlice<f32>, out: &mut CudaSlice<f32>, inner: usize) -> Result<f64> {
    let ms = time_ms(gpu, 2, 15, |i| {
        for s in 0..inner {
            k.delta_rule(heads, x, &segs[(i * inner + s) % segs.len()], GpuStates::Pool(&mut *pool), &mut *out)?;
        }
        Ok(())
    })?;
    Ok(ms / inner as f64)
}

fn decode(gpu: &Gpu, k: &mut GatedDeltaCuda, heads: &DeltaRuleHeads, rng: &mut Lcg, copy_bw: f64) -> Result<()> {
    let state_bytes = heads.state_len() * 4;
    println!("\ndecode (one token per sequence, fused L2 norm of q/k, state f32 [32][128][128] per sequence)");
    println!("{:>6} {:>7} {:>10} {:>12} {:>10}", "batch", "rows", "us/step", "state GB/s", "of copy");
    // `batch=N` on the command line times that batch alone (e.g. under a profiler).
    let only: Option<usize> = std::env::args().find_map(|a| a.strip_prefix("batch=").and_then(|n| n.parse().ok()));
    for b in [1usize, 16, 64, 256].into_iter().filter(|b| only.is_none_or(|o| o == *b)) {
        // Rotate through enough slots that the pools exceed the 60 MB L2 several times over.
        let rot = (1024usize * (1 << 20) / (b * state_bytes)).clamp(1, 64);
        let mut pool = gpu.upload(&rng.vec(rot * b * heads.state_len(), -0.5, 0.5))?;
        let segs: Vec<GpuSegments> = (0..rot).map(|r| GpuSegments::decode(gpu, &(r * b..(r + 1) * b).collect::<Vec<_>>())).collect::<Result<_>>()?;
        let l = layer(gpu, rng, heads, b)?;
        let x = inputs(heads, &l);
        let mut out = gpu.zeros::<f32>(b * heads.n_v_heads * heads.d_v)?;
        let inner = 50;
        let report = |b: usize, name: &str, ms: f64| {
            let bw = 2.0 * (b * state_bytes) as f64 / (ms * 1e-3);
            println!("{:>6} {:>7} {:>10.2} {:>12.0} {:>9.1}%", b, name, ms * 1e3, bw / 1e9, 100.0 * bw / copy_bw);
            println!("RESULT decode batch={b} rows={name} us={:.3} state_gbps={:.1} copy_fraction={:.4}", ms * 1e3, bw / 1e9, bw / copy_bw);
        };
        // For scale: a device-to-device copy of the step's bytes (the state read, then written),
        // with its own launch and ramp, rotating like the pools.
        {
            let n = b * heads.state_len();
            let mut bufs = (0..rot.max(2)).map(|_| gpu.zeros::<f32>(n)).collect::<Result<Vec<_>>>()?;
            let len = bufs.len();
            let ms = time_ms(gpu, 2, 15, |i| {
                for s in 0..inner {
                    let d = (i * inner + s) % len;
                    // Buffer d into buffer d + 1 (the last into the first).
                    if d + 1 < len {
                        let (lo, hi) = bufs.split_at_mut(d + 1);
                        gpu.copy(&lo[d], &mut hi[0])?;
                    } else {
                        let (lo, hi) = bufs.split_at_mut(1);
                        gpu.copy(&hi[len - 2], &mut lo[0])?;
                    }
                }
                Ok(())
            })? / inner as f64;
            report(b, "copy", ms);
        }
        // The model's decode step: gates, recurrence and gated norm in one launch (the fused
        // form, one block per (sequence, head)), on the same states.
        {
            let nv = heads.n_v_heads;
            let dt_bias = gpu.upload(&rng.vec(nv, -0.5, 0.5))?;
            let a = gpu.upload(&rng.vec(nv, -1.0, -0.1))?;
            let z = gpu.upload(&rng.vec(b * nv * heads.d_v, -1.0, 1.0))?;
            let norm = gpu.upload(&rng.vec(heads.d_v, 0.5, 1.5))?;
            let fused = FusedGatesNorm { dt_bias: &dt_bias, a: &a, z: Rows { buf: &z, offset: 0, stride: nv * heads.d_v }, norm: &norm, eps: 1e-6 };
            let x = GpuDeltaRuleInputs { fused: Some(fused), ..inputs(heads, &l) };
            // The default (scatter sums, bounded to two blocks a multiprocessor), then the same
            // with the rows' sums by butterflies (`fused_b`: the same bits), and both unbounded
            // (`fused_u`, `fused_bu`).
            for (scatter, bound64, name) in [(ScatterSums::On, true, "fused"), (ScatterSums::Off, true, "fused_b"), (ScatterSums::On, false, "fused_u"), (ScatterSums::Off, false, "fused_bu")] {
                k.set_scatter_sums(scatter);
                k.set_fused_bound64(bound64);
                let ms = steps_ms(gpu, k, heads, &x, &segs, &mut pool, &mut out, inner)?;
                report(b, name, ms);
            }
            k.set_scatter_sums(ScatterSums::On);
            k.set_fused_bound64(true);
        }
        // The default form replayed from a graph of `inner` steps, as fla's kernels are timed;
        // then with the butterflies' sums (`graph_b`), with each sequence's slot and row loaded
        // from the batch's tables (`graph_t`; each step's slots are consecutive, so by default
        // the kernel computes them), and the (8, 1) form with the scatter sums in 64 registers
        // (`graph_s64`); and the default in blocks of 1 and 2 warps (`graph_w1`, `graph_w2`: fla's
        // recurrence runs one warp a block).
        for (scatter, direct, warps, name) in [
            (ScatterSums::On, true, RECURRENCE_BLOCK_WARPS, "graph"),
            (ScatterSums::Off, true, RECURRENCE_BLOCK_WARPS, "graph_b"),
            (ScatterSums::On, false, RECURRENCE_BLOCK_WARPS, "graph_t"),
            (ScatterSums::On, true, 1, "graph_w1"),
            (ScatterSums::On, true, 2, "graph_w2"),
            (ScatterSums::Registers64, true, RECURRENCE_BLOCK_WARPS, "graph_s64"),
        ] {
            k.set_scatter_sums(scatter);
            k.set_direct_addressing(direct);
            k.set_recurrence_block_warps(warps)?;
            if scatter == ScatterSums::Registers64 {
                k.set_recurrence_variant(Some((8, 1)))?;
            }
            let mut n = 0usize;
            // A form the stream cannot record is reported and skipped.
            let recorded = timing::record_graph(gpu, || {
                for _ in 0..inner {
                    k.delta_rule(heads, &x, &segs[n % rot], GpuStates::Pool(&mut pool), &mut out)?;
                    n += 1;
                }
                Ok(())
            });
            match recorded {
                Ok(graph) => report(b, name, time_ms(gpu, 2, 15, |_| graph.launch().map_err(timing::err))? / inner as f64),
                Err(e) => eprintln!("{name}: {e:?}"),
            }
        }
        k.set_scatter_sums(ScatterSums::On);
        k.set_direct_addressing(true);
        k.set_recurrence_block_warps(RECURRENCE_BLOCK_WARPS)?;
        k.set_recurrence_variant(None)?;
        // The default on one pool, not rotated (`graph_l2`): where the states fit in the L2 (one
        // and 16 sequences) every step reads and writes them there, so its time is the kernel's
        // latency without the memory's; scripts/bench_gdn_fla.py times fla's the same way.
        {
            let recorded = timing::record_graph(gpu, || {
                for _ in 0..inner {
                    k.delta_rule(heads, &x, &segs[0], GpuStates::Pool(&mut pool), &mut out)?;
                }
                Ok(())
            });
            match recorded {
                Ok(graph) => report(b, "graph_l2", time_ms(gpu, 2, 15, |_| graph.launch().map_err(timing::err))? / inner as f64),
                Err(e) => eprintln!("graph_l2: {e:?}"),
            }
        }
        // The default (rows per warp chosen by batch), then every variant in every block size.
        let runs = std::iter::once((None, RECURRENCE_BLOCK_WARPS)).chain(RECURRENCE_VARIANTS.into_iter().flat_map(|r| RECURRENCE_BLOCK_WARP_CHOICES.map(|w| (Some(r), w))));
        for (rows, warps) in runs {
            k.set_recurrence_variant(rows)?;
            k.set_recurrence_block_warps(warps)?;
            let ms = steps_ms(gpu, k, heads, &x, &segs, &mut pool, &mut out, inner)?;
            report(b, &rows.map_or("default".into(), |r| format!("{}x{}w{}", r.0, r.1, warps)), ms);
        }
        // With the butterflies' sums, stream-launched: the default (`default_b`), the (8, 1) and
        // (8, 2) forms (`8x1_b`, `8x2_b`); and (8, 1) with the scatter sums in 64 registers
        // (`8x1_s64`).
        k.set_recurrence_block_warps(RECURRENCE_BLOCK_WARPS)?;
        for (rows, scatter, name) in [(None, ScatterSums::Off, "default_b"), (Some((8, 1)), ScatterSums::Off, "8x1_b"), (Some((8, 2)), ScatterSums::Off, "8x2_b"), (Some((8, 1)), ScatterSums::Registers64, "8x1_s64")] {
            k.set_recurrence_variant(rows)?;
            k.set_scatter_sums(scatter);
            let ms = steps_ms(gpu, k, heads, &x, &segs, &mut pool, &mut out, inner)?;
            report(b, name, ms);
        }
        k.set_scatter_sums(ScatterSums::On);
        k.set_recurrence_variant(None)?;
    }

    k.set_recurrence_variant(None)?;
    k.set_recurrence_block_warps(RECURRENCE_BLOCK_WARPS)?;
    Ok(())
}

fn prefill(gpu: &Gpu, k: &mut GatedDeltaCuda, heads: &DeltaRuleHeads, rng: &mut Lcg, copy_bw: f64) -> Result<()> {
    println!("\nprefill (one sequence, one layer, fused L2 norm of q/k; error vs the device sequential scan)");
    println!(
        "{:>6} {:>9} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "tokens", "scan ms", "chunk32 ms", "chunk64 ms", "fast ms", "c32 out", "c32 state", "fast out", "fast st", "fast par", "of floor"
    );
    let only: Option<usize> = std::env::args().find_map(|a| a.strip_prefix("tokens=").and_then(|n| n.parse().ok()));
    for t in [2048usize, 8192, 32768].into_iter().filter(|t| only.is_none_or(|o| o == *t)) {
        let l = layer(gpu, rng, heads, t)?;
        let x = inputs(heads, &l);
        let init = rng.vec(heads.state_len(), -0.5, 0.5);
        let segs = GpuSegments::new(gpu, &pack([t]), &[0], t)?;
        let n_out = t * heads.n_v_heads * heads.d_v;
        let mut st = gpu.upload(&init)?;
        let mut out = gpu.zeros::<f32>(n_out)?;
        let scan_ms = time_ms(gpu, 1, 3, |_| {
            gpu.write(&init, &mut st)?;
            k.delta_rule(heads, &x, &segs, GpuStates::Pool(&mut st), &mut out)
        })?;
        let (want_out, want_st) = (gpu.download(&out)?, gpu.download(&st)?);
        // (total ms, parallel pass alone ms, output error, state error) per mode.
        let mut res = vec![];
        for acc in [Some(ChunkAccumulate::F32), Some(ChunkAccumulate::F64), None] {
            let run = |k: &GatedDeltaCuda, st: &mut tern::cuda::CudaSlice<f32>, out: &mut tern::cuda::CudaSlice<f32>| match acc {
                Some(acc) => k.delta_rule_chunked(heads, &x, &segs, GpuStates::Pool(st), out, acc),
                None => k.delta_rule_chunked_fast(heads, &x, &segs, GpuStates::Pool(st), out),
            };
            let ms = time_ms(gpu, 2, 10, |_| run(k, &mut st, &mut out))?;
            k.set_chunk_prepare_only(true);
            let prep = time_ms(gpu, 2, 10, |_| run(k, &mut st, &mut out))?;
            k.set_chunk_prepare_only(false);
            let name = acc.map_or("fast".to_string(), |a| format!("{a:?}"));
            println!("RESULT prefill_split tokens={t} mode={name} total_ms={ms:.4} parallel_pass_ms={prep:.4} state_pass_ms={:.4}", ms - prep);
            if acc.is_none() {
                for v in k.fast_variants() {
                    k.set_fast_variant(v)?;
                    let vms = time_ms(gpu, 2, 10, |_| run(k, &mut st, &mut out))?;
                    k.set_chunk_prepare_only(true);
                    let vprep = time_ms(gpu, 2, 10, |_| run(k, &mut st, &mut out))?;
                    k.set_chunk_prepare_only(false);
                    // Each variant's error against the scan (the segmented ones may differ).
                    gpu.write(&init, &mut st)?;
                    run(k, &mut st, &mut out)?;
                    let (eo, es) = (rel_err(&gpu.download(&out)?, &want_out), rel_err(&gpu.download(&st)?, &want_st));
                    println!(
                        "RESULT prefill_fast_variant tokens={t} rows={} stages={} compact={} late_issue={} tiled={} cluster={} warpgroup={} transposed={} state_rows={} segments={} total_ms={vms:.4} parallel_pass_ms={vprep:.4} state_pass_ms={:.4} out_err={eo:.3e} state_err={es:.3e}",
                        v.rows,
                        v.stages,
                        v.compact,
                        v.late_issue,
                        v.tiled,
                        v.cluster,
                        v.warpgroup,
                        v.transposed,
                        v.state_rows,
                        v.segments,
                        vms - vprep
                    );
                }
                k.set_fast_variant(k.default_fast_variant())?;
            } else {
                k.set_chunk_state_rows(8)?;
                let ms8 = time_ms(gpu, 2, 10, |_| run(k, &mut st, &mut out))?;
                k.set_chunk_state_rows(CHUNK_STATE_ROWS)?;
                println!("RESULT prefill_state_rows8 tokens={t} acc={name} total_ms={ms8:.4}");
            }
            gpu.write(&init, &mut st)?;
            run(k, &mut st, &mut out)?;
            res.push((ms, prep, rel_err(&gpu.download(&out)?, &want_out), rel_err(&gpu.download(&st)?, &want_st)));
        }
        // The fewest bytes: q, k, v read and the output written once (f32), the state read and
        // written once.
        let floor_bytes = 4 * (t * (2 * heads.n_k_heads * heads.d_k + 2 * heads.n_v_heads * heads.d_v) + 2 * heads.state_len());
        let floor_ms = floor_bytes as f64 / copy_bw * 1e3;
        let fast = res[2];
        println!(
            "{:>6} {:>9.3} {:>10.3} {:>10.3} {:>9.3} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.3} {:>7.0}%",
            t, scan_ms, res[0].0, res[1].0, fast.0, res[0].2, res[0].3, fast.2, fast.3, fast.1, 100.0 * floor_ms / fast.0
        );
        for (name, r) in [("chunk_f32acc", res[0]), ("chunk_f64acc", res[1]), ("fast_bf16", fast)] {
            println!("RESULT prefill tokens={t} mode={name} ms={:.4} out_err={:.3e} state_err={:.3e}", r.0, r.2, r.3);
        }
        println!("RESULT prefill tokens={t} mode=scan ms={scan_ms:.4}");
        println!("RESULT prefill_floor tokens={t} bytes={floor_bytes} floor_ms={floor_ms:.4} fast_fraction={:.4}", floor_ms / fast.0);
        two_pass_floor(heads, t, 4, copy_bw, (fast.0, fast.1));
        bf16_io(gpu, k, heads, &l, &segs, &init, &want_out, copy_bw)?;
    }
    Ok(())
}

/// The fewest bytes each pass of the fast prefill moves through device memory, at `io` bytes an
/// element of q, k, v and the output: the prepare pass reads q, k, v, g and beta and writes its
/// operands for the state pass (bf16 W, U, read-out weights per value head and chunk, bf16
/// normalised q and k per key head, f32 decays); the state pass reads those once and writes
/// the output and the state. Printed beside the passes' times (`times`: total and prepare ms).
fn two_pass_floor(heads: &DeltaRuleHeads, t: usize, io: usize, copy_bw: f64, times: (f64, f64)) {
    let DeltaRuleHeads { n_k_heads: nk, n_v_heads: nv, d_k: dk, d_v: dv, .. } = *heads;
    let operands = fast_operand_bytes(heads, t);
    let prepare = io * t * (2 * nk * dk + nv * dv) + 8 * t * nv + operands;
    let state = operands + io * t * nv * dv + 8 * heads.state_len();
    let ms = |bytes: usize| bytes as f64 / copy_bw * 1e3;
    let (total, prep) = times;
    println!(
        "RESULT prefill_two_pass_floor tokens={t} io_bytes={io} prepare_floor_ms={:.4} state_floor_ms={:.4} prepare_fraction={:.4} state_fraction={:.4} total_fraction={:.4}",
        ms(prepare),
        ms(state),
        ms(prepare) / prep,
        ms(state) / (total - prep),
        ms(prepare + state) / total
    );
}

/// The fast prefill with q, k, v and the output in bf16 (the layer's f32 rows rounded), timed
/// whole and without its state pass, its error against the f32 scan (which includes the inputs'
/// rounding) and its time against the fewest bytes at these element sizes.
#[allow(clippy::too_many_arguments)]
fn bf16_io(gpu: &Gpu, k: &mut GatedDeltaCuda, heads: &DeltaRuleHeads, l: &Layer, segs: &GpuSegments, init: &[f32], want_out: &[f32], copy_bw: f64) -> Result<()> {
    let qkv16: Vec<u16> = gpu.download(&l.qkv)?.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
    let qkv16 = gpu.upload(&qkv16)?;
    let qk = heads.n_k_heads * heads.d_k;
    let row = 2 * qk + heads.n_v_heads * heads.d_v;
    let view = |offset| Rows { buf: &qkv16, offset, stride: row };
    let x = GpuBf16DeltaRuleInputs { q: view(0), k: view(qk), v: view(2 * qk), g: &l.g, beta: &l.beta, normalize_qk: true };
    let t = segs.tokens();
    let mut st = gpu.upload(init)?;
    let mut out = gpu.zeros::<u16>(t * heads.n_v_heads * heads.d_v)?;
    let ms = time_ms(gpu, 2, 10, |_| k.delta_rule_chunked_fast_bf16(heads, &x, segs, GpuStates::Pool(&mut st), &mut out))?;
    k.set_chunk_prepare_only(true);
    let prep = time_ms(gpu, 2, 10, |_| k.delta_rule_chunked_fast_bf16(heads, &x, segs, GpuStates::Pool(&mut st), &mut out))?;
    k.set_chunk_prepare_only(false);
    gpu.write(init, &mut st)?;
    k.delta_rule_chunked_fast_bf16(heads, &x, segs, GpuStates::Pool(&mut st), &mut out)?;
    let got: Vec<f32> = gpu.download(&out)?.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
    // q, k, v read and the output written once in bf16, g and beta read in f32, the state read
    // and written once.
    let floor_bytes = 2 * t * (2 * qk + 2 * heads.n_v_heads * heads.d_v) + 8 * t * heads.n_v_heads + 8 * heads.state_len();
    let floor_ms = floor_bytes as f64 / copy_bw * 1e3;
    two_pass_floor(heads, t, 2, copy_bw, (ms, prep));
    println!(
        "RESULT prefill_bf16_io tokens={t} total_ms={ms:.4} parallel_pass_ms={prep:.4} state_pass_ms={:.4} out_err={:.3e} floor_ms={floor_ms:.4} fast_fraction={:.4}",
        ms - prep,
        rel_err(&got, want_out),
        floor_ms / ms
    );
    Ok(())
}
