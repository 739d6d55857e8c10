//! Device tests of the Qwen3.5 forward on CUDA: the LLM ops of the CUDA backend against the
//! CPU backend through the op-set interface (fresh random inputs, outputs poisoned with NaN),
//! then whole models (the tiny golden checkpoints, HF and GGUF) on the GPU against the CPU path:
//! f32 logits within 1e-4 of the logit scale and the same greedy tokens for prompts of 1, 64, 65
//! and 300 tokens and 16 generated tokens; batched decode of sequences of different lengths equal
//! to each sequence alone; the bf16 fast mode's argmax agreement and logit error, printed.
//! Ignored without a GPU; scripts/device-test.sh runs them.

use std::path::PathBuf;

use crate::cuda::test_util::{check, gpu, nan, rng};
use crate::kernels::attention::cuda::KvForm;
use crate::kernels::attention::AttentionShape;
use crate::kernels::backend::{CpuOps, Ops, View};
use crate::kernels::cuda_ops::{CudaOps, Precision};
use crate::kernels::matmul::cuda::GEMV_MAX_ROWS;
use crate::kernels::moe::cuda::MAX_DEVICE_TOP_K;
use crate::kernels::pack;
use crate::kernels::sample::{select_rows, LogitsWant};
use crate::models::qwen35::{Qwen35, Qwen35State};

const BOUND: f64 = 1e-5;
/// Fast mode's routed experts against the f32 CPU (‖Δ‖/‖ref‖): each product's operands are
/// rounded to bf16 (2^-9 relative each), the inputs ±1 and weights ±0.2.
const FAST_MOE_BOUND: f64 = 2e-2;

/// f32 logits against the CPU, relative to the row's logit scale (the golden tests' measure).
const LOGIT_BOUND: f64 = 1e-4;
/// Where one rounding of the input embeddings moves a step's CPU logits by `spread`, the step
/// is that ill-conditioned, and the GPU's logits (other summation orders, every op) may differ
/// from the CPU's by this many times `spread` before the bound above is exceeded. Measured on
/// hostcuda: a random tiny model's decode step can turn one rounding into 1.4e-4 of the logit
/// scale (a gated-delta head whose output is a small remainder of large terms, normalised to
/// unit size, layer after layer), and the GPU then differs by 0.97-1.0 times that spread; over
/// 24 prompts of dense-tied (17 steps each) the ratio ranged 0.5-3.7, the high end only where
/// both lie near 1e-5 (the GPU rounds at every op, the nudge only once).
const SPREAD_FACTOR: f64 = 8.0;

fn fixture(rel: &str) -> PathBuf {
    let here = PathBuf::from("tests/fixtures/qwen35").join(rel);
    if here.exists() {
        return here;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen35").join(rel)
}

fn rel_to_scale(got: &[f32], want: &[f32]) -> f64 {
    assert!(got.iter().all(|v| v.is_finite()), "non-finite logits");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
    got.iter().zip(want).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max) / scale
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).map_or(0, |(i, _)| i)
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_llm_ops_match_cpu() {
    let gpu = gpu();
    let ops = CudaOps::new(gpu.clone(), Precision::F32).unwrap().with_moe_device_sort(false);
    let ops16 = CudaOps::new(gpu.clone(), Precision::Bf16).unwrap().with_moe_device_sort(false);
    // A prompt's MoE slots sorted on the device instead of the host.
    let ops_sorted = CudaOps::new(gpu.clone(), Precision::F32).unwrap().with_moe_device_sort(true);
    let ops16_sorted = CudaOps::new(gpu.clone(), Precision::Bf16).unwrap().with_moe_device_sort(true);
    let cpu = CpuOps;
    let mut rng = rng("cuda_llm_ops_match_cpu");
    let up = |v: &[f32]| gpu.upload(v).unwrap();

    for &(rows, d) in &[(1usize, 64usize), (37, 1024), (300, 96)] {
        let (x, y, w) = (rng.vec(rows * d, -2.0, 2.0), rng.vec(rows * d, -2.0, 2.0), rng.vec(d, 0.5, 1.5));
        let (mut xc, mut ac) = (x.clone(), vec![0.0; rows * d]);
        cpu.residual_norm(&mut xc, &y, &w, d, 1e-6, &mut ac).unwrap();
        let (mut xg, mut ag) = (up(&x), nan(&gpu, rows * d));
        ops.residual_norm(&mut xg, &up(&y), &up(&w), d, 1e-6, &mut ag).unwrap();
        check("residual_norm sum", &gpu.download(&xg).unwrap(), &xc, BOUND);
        check("residual_norm out", &gpu.download(&ag).unwrap(), &ac, BOUND);

        // silu over the two halves of a fused [gate | up] row.
        let gu = rng.vec(rows * 2 * d, -6.0, 6.0);
        let want = cpu.silu_mul(View::new(&gu, 0, 2 * d), View::new(&gu, d, 2 * d), rows, d).unwrap();
        let gug = up(&gu);
        let got = ops.silu_mul(View::new(&gug, 0, 2 * d), View::new(&gug, d, 2 * d), rows, d).unwrap();
        check("silu_mul", &gpu.download(&got).unwrap(), &want, BOUND);

    }

    // KV attention: two calls per sequence (a prefill, then new rows after it), GQA and not,
    // several head sizes (512: the tensor-core kernel's warp pairs under the causal mask); the
    // q | gate | k | v rows as views of one fused projection. The 270-row prefill spans several
    // query and key tiles, so the causal mask meets tiles a warp sees whole and tiles it sees
    // in part.
    // Every form of the decode attention (key ranges and warps a block).
    for form in KvForm::ALL {
        let ops = CudaOps::new(gpu.clone(), Precision::F32).unwrap().with_kv_form(form);
        for &(qh, kvh, hd) in &[(8usize, 2usize, 256usize), (4, 4, 64), (2, 1, 128), (6, 3, 32), (2, 1, 512)] {
            let shape = AttentionShape { q_heads: qh, kv_heads: kvh, hd, scale: (hd as f32).powf(-0.5), max_distance: None };
            let (qw, kw) = (qh * hd, kvh * hd);
            let stride = 2 * qw + 2 * kw;
            let mut cpu_caches: Vec<_> = (0..3).map(|_| cpu.kv_cache(kw).unwrap()).collect();
            let mut gpu_caches: Vec<_> = (0..3).map(|_| ops.kv_cache(kw).unwrap()).collect();
            let mut past = vec![0usize; 3];
            // The third call is a decode step (every sequence one row), whose own keys and values
            // the attention kernel reads from the projection and appends itself. The long prompts
            // go to the forms a process takes by default (one sequence at a time, and a server's
            // rounds); the others differ only in the decode kernel (not the prefill's flash
            // kernels): shorter prompts, which still give each warp of 16 one to four keys at once.
            let long = form == KvForm::DEFAULT || form == KvForm::BATCHED;
            let calls = if long { [[3usize, 270, 1], [1, 5, 300], [1, 1, 1]] } else { [[3, 160, 1], [1, 5, 120], [1, 1, 1]] };
            for lens in calls {
                let segs = pack(lens);
                let n: usize = lens.iter().sum();
                let y = rng.vec(n * stride, -1.5, 1.5);
                let ids = vec![0u32; n];
                let cb = cpu.batch_at(&segs, &ids, &past).unwrap();
                let gb = ops.batch_at(&segs, &ids, &past).unwrap();
                let at = |o| View::new(&y, o, stride);
                let mut cc: Vec<_> = cpu_caches.iter_mut().collect();
                let want = cpu.kv_attention(at(0), at(2 * qw), at(2 * qw + kw), at(qw), &cb, &mut cc, &shape).unwrap();
                let yg = up(&y);
                let atg = |o| View::new(&yg, o, stride);
                // As a model step does: each cache is reserved for the step before it runs.
                for ((c, &p), &l) in gpu_caches.iter_mut().zip(&past).zip(&lens) {
                    ops.kv_reserve(c, p, p + l).unwrap();
                }
                let mut gc: Vec<_> = gpu_caches.iter_mut().collect();
                let got = ops.kv_attention(atg(0), atg(2 * qw), atg(2 * qw + kw), atg(qw), &gb, &mut gc, &shape).unwrap();
                check(&format!("kv_attention {form:?} {qh}/{kvh}×{hd} lens {lens:?} past {past:?}"), &gpu.download(&got).unwrap(), &want, BOUND);
                if past.iter().all(|&p| p == 0) && form == KvForm::DEFAULT {
                    // From empty caches the prefill runs on the flash kernels; the bf16 form's
                    // tensor-core products round q, k, v and P to bf16 (the encoder test's bound).
                    let gb16 = ops16.batch_at(&segs, &ids, &past).unwrap();
                    let mut caches16: Vec<_> = (0..3).map(|_| ops16.kv_cache(kw).unwrap()).collect();
                    let mut gc16: Vec<_> = caches16.iter_mut().collect();
                    let fast = ops16.kv_attention(atg(0), atg(2 * qw), atg(2 * qw + kw), atg(qw), &gb16, &mut gc16, &shape).unwrap();
                    check(&format!("kv prefill bf16 {qh}/{kvh}×{hd} lens {lens:?}"), &gpu.download(&fast).unwrap(), &want, 1.5e-2);
                    let keys16 = gpu.download(&caches16[1].keys).unwrap();
                    assert_eq!(&keys16[..lens[1] * kw], &cpu_caches[1].keys[..], "bf16 prefill: the cache holds the f32 keys");
                }
                past.iter_mut().zip(lens).for_each(|(p, l)| *p += l);
            }
            // Every row each sequence appended (the decode step's too) is in its cache as the CPU's.
            for (s, (gc, cc)) in gpu_caches.iter().zip(&cpu_caches).enumerate() {
                let n = past[s] * kw;
                assert_eq!(&gpu.download(&gc.keys).unwrap()[..n], &cc.keys[..n], "kv {qh}/{kvh}×{hd}: sequence {s}'s keys");
                assert_eq!(&gpu.download(&gc.values).unwrap()[..n], &cc.values[..n], "kv {qh}/{kvh}×{hd}: sequence {s}'s values");
            }
            // A cache that does not end where the batch starts is refused.
            let segs = pack([1]);
            let y = vec![0.0f32; stride];
            let gb = ops.batch_at(&segs, &[0], &[0]).unwrap();
            let yg = up(&y);
            let mut one = vec![&mut gpu_caches[0]];
            let at = |o| View::new(&yg, o, stride);
            assert!(ops.kv_attention(at(0), at(2 * qw), at(2 * qw + kw), at(qw), &gb, &mut one, &shape).is_err());
        }
    }

    // The routed experts against the CPU's loop: up to GEMV_MAX_ROWS rows routed on the device
    // (routed GEMVs, then the combine), more with their slots sorted by expert (each expert's
    // products over its rows, then the combine through the sorted positions); top-k past the
    // device routing's limit routes on the host. A shared expert (width `sw`, 0: none; its gate
    // the logits' last column) of the routed experts' width is each row's last routed slot in
    // a decode step, of another width a dense MLP added after the combine, as in a prompt.
    // Q8_0 experts (whole 32-weight blocks: d and width multiples of 32) take the routed Q8_0
    // GEMVs, or are expanded for the sorted rows' products.
    for &(rows, d, width, ne, k, q8, sw) in &[
        (1usize, 64usize, 32usize, 8usize, 2usize, false, 0usize),
        (5, 64, 32, 16, 4, false, 32),
        (3, 64, 32, 8, 2, false, 40),
        (8, 128, 48, 40, 8, false, 48),
        (45, 128, 48, 16, 4, false, 48),
        (9, 64, 32, 4, 4, false, 0),
        (300, 64, 32, 24, 24, false, 40),
        (1, 64, 64, 8, 2, true, 64),
        (7, 128, 64, 16, 4, true, 32),
        (300, 128, 64, 64, 8, true, 64),
        (33, 64, 32, 40, 17, true, 0),
        (2, 64, 32, 20, 16, false, 32),
        (1, 100, 32, 8, 2, false, 32),
        (40, 64, 32, 16, 4, true, 0),
        (20, 64, 36, 8, 2, false, 0),
    ] {
        use crate::formats::{Matrix, Q8Tensor, Tensor};
        let mk = |r: usize, c: usize, rng: &mut crate::kernels::gated_delta::test_util::Lcg| {
            let w = rng.vec(r * c, -0.2, 0.2);
            if !q8 {
                return Matrix::F32(Tensor::owned("e", vec![r, c], w));
            }
            let bytes = crate::kernels::matmul::quantize_q8_0(&w);
            let mut map = memmap2::MmapOptions::new().len(bytes.len()).map_anon().unwrap();
            map.copy_from_slice(&bytes);
            Matrix::Q8_0(Q8Tensor::mapped("e".into(), vec![r, c], std::sync::Arc::new(map.make_read_only().unwrap()), 0).unwrap())
        };
        let experts: Vec<[Matrix; 3]> = (0..ne).map(|_| [mk(width, d, &mut rng), mk(width, d, &mut rng), mk(d, width, &mut rng)]).collect();
        let shared = (sw > 0).then(|| [mk(sw, d, &mut rng), mk(sw, d, &mut rng), mk(d, sw, &mut rng)]);
        let x = rng.vec(rows * d, -1.0, 1.0);
        // Logits on a grid of quarters: many equal probabilities, whose ties both routings
        // must break alike (the lower expert first).
        let logits: Vec<f32> = rng.vec(rows * (ne + (sw > 0) as usize), -3.0, 3.0).iter().map(|v| (v * 4.0).round() / 4.0).collect();
        let cpu_experts = cpu.experts(experts.clone(), shared.clone()).unwrap();
        let want = cpu.moe(&x, d, &logits, &cpu_experts, k).unwrap();
        let gpu_experts = ops.experts(experts.clone(), shared.clone()).unwrap();
        let got = ops.moe(&up(&x), d, &up(&logits), &gpu_experts, k).unwrap();
        let what = format!("moe {rows}×{d}, {ne} experts top-{k}, q8_0 {q8}, shared width {sw}");
        check(&what, &gpu.download(&got).unwrap(), &want, BOUND);
        // Fast mode: bf16 operands (tensor-core products for the sorted rows), the same
        // routing; the error is that of the operands' bf16 rounding.
        let gpu_experts16 = ops16.experts(experts, shared).unwrap();
        let fast = ops16.moe(&up(&x), d, &up(&logits), &gpu_experts16, k).unwrap();
        check(&format!("fast {what}"), &gpu.download(&fast).unwrap(), &want, FAST_MOE_BOUND);
        // A prompt's rows whose experts get few rows each run as GEMVs over tiles of them,
        // which in f32 mode give each row the bits of a decode step of that row alone (without
        // a shared expert, which a prompt runs as a dense MLP; device routing only). Every
        // expert is taken in these shapes (k of ne experts for each of many rows), so the tiles
        // are chosen by rows·k <= 16·ne. (Fast mode's bf16 tiles run on the tensor cores, x
        // rounded to bf16, where a decode step keeps f32 x: the bound above.)
        let tiles_every_expert = rows > GEMV_MAX_ROWS && k <= MAX_DEVICE_TOP_K && width % 8 == 0 && rows * k <= 16 * ne;
        if sw == 0 && tiles_every_expert {
            let got = gpu.download(&got).unwrap();
            for r in [0, rows / 2, rows - 1] {
                let one = gpu.download(&ops.moe(&up(&x[r * d..(r + 1) * d]), d, &up(&logits[r * ne..(r + 1) * ne]), &gpu_experts, k).unwrap()).unwrap();
                assert_eq!(one, got[r * d..(r + 1) * d], "{what}: row {r} of the prompt == the row alone");
            }
        }
        // The slots sorted on the device: the CPU's result within the bound and, where both
        // forms take the tiles (every expert used, as above), the host sort's bits. (A shared
        // expert of another width runs as a dense MLP after either.)
        for (mode, o, e, host, bound) in [("f32", &ops_sorted, &gpu_experts, &got, BOUND), ("fast", &ops16_sorted, &gpu_experts16, &fast, FAST_MOE_BOUND)] {
            let sorted = gpu.download(&o.moe(&up(&x), d, &up(&logits), e, k).unwrap()).unwrap();
            check(&format!("{mode} {what}, sorted on the device"), &sorted, &want, bound);
            if tiles_every_expert {
                assert_eq!(sorted, gpu.download(host).unwrap(), "{mode} {what}: sorted on the device == on the host");
            }
        }

        // The layer's MoE and the residual step after it (a one-row decode step fuses the down
        // products, their sum, the residual add and the norm into one launch): against the
        // CPU, and the same bits as the two ops on the GPU; twice over (the fused norm's
        // arrival counter resets).
        let (x0, nw) = (rng.vec(rows * d, -2.0, 2.0), rng.vec(d, 0.5, 1.5));
        let (mut want_x, mut want_a) = (x0.clone(), x.clone());
        cpu.moe_residual_norm(&mut want_a, d, &logits, &cpu_experts, k, &mut want_x, &nw, 1e-6).unwrap();
        for (mode, o, e, bound) in [("f32", &ops, &gpu_experts, BOUND), ("fast", &ops16, &gpu_experts16, FAST_MOE_BOUND)] {
            let (dl, dnw) = (up(&logits), up(&nw));
            let y = o.moe(&up(&x), d, &dl, e, k).unwrap();
            let (mut xu, mut au) = (up(&x0), nan(&gpu, rows * d));
            o.residual_norm(&mut xu, &y, &dnw, d, 1e-6, &mut au).unwrap();
            let (xu, au) = (gpu.download(&xu).unwrap(), gpu.download(&au).unwrap());
            for pass in 0..2 {
                let (mut xg, mut ag) = (up(&x0), up(&x));
                o.moe_residual_norm(&mut ag, d, &dl, e, k, &mut xg, &dnw, 1e-6).unwrap();
                let (xg, ag) = (gpu.download(&xg).unwrap(), gpu.download(&ag).unwrap());
                assert_eq!(xg, xu, "{mode} {what}: moe_residual_norm stream == moe, residual_norm (pass {pass})");
                assert_eq!(ag, au, "{mode} {what}: moe_residual_norm norm == moe, residual_norm (pass {pass})");
            }
            check(&format!("{mode} {what}: moe + residual stream"), &xu, &want_x, bound);
            check(&format!("{mode} {what}: moe + residual norm"), &au, &want_a, bound);
        }
    }
}

/// Feeds `ids` to both models and compares the last-token logits.
fn step(cpu: &Qwen35, gpu: &Qwen35<CudaOps>, ids: &[u32], cs: &mut Qwen35State, gs: &mut Qwen35State<CudaOps>) -> (Vec<f32>, Vec<f32>) {
    (cpu.forward(ids, cs).unwrap(), gpu.forward(ids, gs).unwrap())
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_qwen35_matches_cpu() {
    let g = gpu();
    let mut rng = rng("cuda_qwen35_matches_cpu");
    let models = [
        "dense-untied",
        // d_k 32: decode steps through the fused recurrence (the others' 16 take the chunked form).
        "dense-scan/gguf/dense-scan-bf16.gguf",
        "dense-tied/gguf/dense-tied-f32.gguf",
        "dense-untied/gguf/dense-untied-q8_0.gguf",
        "moe",
        "moe/gguf/moe-bf16.gguf",
    ];
    for rel in models {
        let path = fixture(rel);
        let cpu = Qwen35::load(&path).unwrap();
        // Its own stream of coin flips, so that the prompts stay those of the seed.
        let mut coins = crate::kernels::gated_delta::test_util::Lcg(0x6e75_6467_65);
        let nudged = Qwen35::load(&path).unwrap().with_nudged_embeddings(|| coins.next_u32() & 1 == 1).unwrap();
        let f32m = Qwen35::load_on(&path, CudaOps::new(g.clone(), Precision::F32).unwrap()).unwrap();
        let bf16m = Qwen35::load_on(&path, CudaOps::new(g.clone(), Precision::Bf16).unwrap()).unwrap();
        let vocab = cpu.cfg.vocab_size as u32;
        let (mut worst, mut worst_fast, mut fast_agree, mut steps) = (0.0f64, 0.0f64, 0usize, 0usize);
        let (mut worst_spread, mut widened) = (0.0f64, 0usize);
        for len in [1usize, 64, 65, 300] {
            let prompt: Vec<u32> = (0..len).map(|_| rng.next_u32() % vocab).collect();
            let (mut cs, mut gs, mut fs) = (cpu.new_state().unwrap(), f32m.new_state().unwrap(), bf16m.new_state().unwrap());
            let mut ns = nudged.new_state().unwrap();
            let mut feed = prompt;
            for t in 0..=16 {
                let (want, got) = step(&cpu, &f32m, &feed, &mut cs, &mut gs);
                let fast = bf16m.forward(&feed, &mut fs).unwrap();
                let spread = rel_to_scale(&nudged.forward(&feed, &mut ns).unwrap(), &want);
                let bound = LOGIT_BOUND.max(SPREAD_FACTOR * spread);
                let e = rel_to_scale(&got, &want);
                assert!(
                    e <= bound,
                    "{rel}: prompt {len}, step {t}: GPU f32 logits {e:e} of the scale from the CPU's (bound {bound:e}; \
                     one rounding of the input embeddings moves the CPU's by {spread:e})"
                );
                // The same greedy token, unless the CPU's best two lie within this step's
                // difference of each other (a tie that any rounding may break either way).
                let (ga, wa) = (argmax(&got), argmax(&want));
                let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
                assert!(
                    ga == wa || ((want[wa] - want[ga]) as f64) <= e * scale,
                    "{rel}: prompt {len}, step {t}: greedy tokens differ ({ga} vs the CPU's {wa}, {:e} apart)",
                    (want[wa] - want[ga]) as f64 / scale
                );
                worst_spread = worst_spread.max(spread);
                widened += (bound > LOGIT_BOUND) as usize;
                worst = worst.max(e);
                worst_fast = worst_fast.max(rel_to_scale(&fast, &want));
                fast_agree += (argmax(&fast) == argmax(&want)) as usize;
                steps += 1;
                // Greedy: the CPU's token goes to all three, so later steps compare like with like.
                feed = vec![argmax(&want) as u32];
            }
        }
        // Batched decode: sequences of different lengths step together; each gets the logits
        // it gets alone.
        let lens = [1usize, 64, 65];
        let prompts: Vec<Vec<u32>> = lens.iter().map(|&n| (0..n).map(|_| rng.next_u32() % vocab).collect()).collect();
        let mut together: Vec<_> = prompts.iter().map(|_| f32m.new_state().unwrap()).collect();
        let mut alone: Vec<_> = prompts.iter().map(|_| f32m.new_state().unwrap()).collect();
        // A third copy steps as a server's batch does, each sequence asking for what its
        // sampler reads: the device's picks equal the CPU twin's picks from the whole rows.
        let mut picking: Vec<_> = prompts.iter().map(|_| f32m.new_state().unwrap()).collect();
        let wants = [
            LogitsWant::ARGMAX,
            LogitsWant::Best { divisor: 0.8, count: 40 },
            LogitsWant::Full,
        ];
        let mut next: Vec<u32> = Vec::new();
        for (p, ((a, b), c)) in prompts.iter().zip(together.iter_mut().zip(alone.iter_mut()).zip(picking.iter_mut())) {
            let l = f32m.forward(p, a).unwrap();
            f32m.forward(p, b).unwrap();
            f32m.forward(p, c).unwrap();
            next.push(argmax(&l) as u32);
        }
        let mut worst_batch = 0.0f64;
        for round in 0..4 {
            let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let mut batch: Vec<(&[u32], &mut Qwen35State<CudaOps>)> = toks.iter().map(|t| t.as_slice()).zip(together.iter_mut()).collect();
            let out = f32m.forward_batch(&mut batch).unwrap();
            let mut batch: Vec<(&[u32], &mut Qwen35State<CudaOps>)> = toks.iter().map(|t| t.as_slice()).zip(picking.iter_mut()).collect();
            let picked = f32m.forward_batch_wants(&mut batch, &wants).unwrap();
            let from_rows = select_rows(out.clone(), f32m.cfg.vocab_size, &wants).unwrap();
            for (i, ((w, p), want)) in wants.iter().zip(picked).zip(from_rows).enumerate() {
                assert_eq!(p, want, "{rel}: round {round}, sequence {i}: {w:?} from the device vs from the whole row");
            }
            for (i, (t, s)) in toks.iter().zip(alone.iter_mut()).enumerate() {
                let own = f32m.forward(t, s).unwrap();
                let e = rel_to_scale(&out[i], &own);
                assert!(e <= LOGIT_BOUND, "{rel}: round {round}, sequence {i}: batched vs alone {e:e}");
                worst_batch = worst_batch.max(e);
                next[i] = argmax(&own) as u32;
            }
        }
        // Decode steps are recorded once per key and replayed (the logits above came from
        // replays), MoE ones too: a few rows route on the device.
        let (recorded, failed) = f32m.ops().graph_stats();
        assert!(failed.is_empty(), "{rel}: decode recordings failed: {failed:?}");
        assert!(recorded > 0, "{rel}: no decode step was recorded");
        eprintln!(
            "{rel}: GPU f32 vs CPU ≤ {worst:.2e} of the logit scale (one rounding of the input moves the CPU's ≤ {worst_spread:.2e}; \
             bound widened for {widened} steps); batched vs alone ≤ {worst_batch:.2e}; \
             bf16: argmax agrees {fast_agree}/{steps}, logits ≤ {worst_fast:.2e} of the scale; {} device weight bytes (f32)",
            f32m.ops().weight_bytes()
        );
    }
}

/// The device sort of a prompt's MoE slots (`MoeCuda::sort_slots`) against the host's counting
/// sort and `expert_tiles`: the same sorted row for every slot, input row for every sorted row,
/// and tiles, outputs poisoned first; routings spread over all experts and crowded onto a few
/// (experts of many rows: several tiles each), up to the kernel's 1024 experts.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_moe_sort_slots_matches_the_host_sort() {
    use crate::kernels::matmul::cuda::expert_tiles;
    use crate::kernels::moe::cuda::{sort_slots_on_host, MoeCuda, SlotOrder, SortedSlots};
    let gpu = gpu();
    let moe = MoeCuda::new(gpu.clone()).unwrap();
    let mut rng = rng("cuda_moe_sort_slots_matches_the_host_sort");
    for &(rows, k, ne, crowded) in &[(1usize, 1usize, 1usize, false), (9, 2, 8, false), (33, 4, 16, true), (128, 8, 256, false), (300, 8, 64, true), (1000, 8, 1024, false), (17, 3, 5, true), (2500, 8, 256, false), (2731, 3, 128, true)] {
        // The last two pass the kernel's 8192 ids staged at a time: 20 000 slots, and 8 193.
        // Each row's k distinct experts in ascending order, as the routing writes them; crowded
        // routings draw from the first k + 1 experts only.
        let pool = if crowded { (k + 1).min(ne) } else { ne };
        let mut ids = Vec::with_capacity(rows * k);
        for _ in 0..rows {
            let mut row: Vec<usize> = Vec::new();
            while row.len() < k {
                let e = (rng.next_u32() as usize) % pool;
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            row.sort_unstable();
            ids.extend(row);
        }
        let slots = ids.len();
        let SlotOrder { start, token, pos } = sort_slots_on_host(&ids, k, ne);
        let tiles: Vec<i32> = expert_tiles(&start).unwrap().into_iter().flatten().collect();

        let dids = gpu.upload(&ids.iter().map(|&e| e as i32).collect::<Vec<_>>()).unwrap();
        let mut got = moe.sort_slots(&dids, k, ne).unwrap();
        assert_eq!(got.max_tiles, SortedSlots::max_tiles(slots, ne));
        // Poisoned, then sorted again into the same buffers: every entry the host has must be
        // written.
        gpu.poison(&mut got.token).unwrap();
        gpu.poison(&mut got.pos).unwrap();
        gpu.poison(&mut got.tiles).unwrap();
        gpu.poison(&mut got.n_tiles).unwrap();
        moe.sort_slots_into(&dids, k, ne, &mut got).unwrap();
        let again = got;
        let what = format!("sort of {rows} rows × top-{k} over {ne} experts (crowded {crowded})");
        let n = gpu.download(&again.n_tiles).unwrap()[0] as usize;
        assert_eq!(n * 3, tiles.len(), "{what}: tile count");
        assert!(n <= again.max_tiles, "{what}: {n} tiles in room for {}", again.max_tiles);
        assert_eq!(gpu.download(&again.pos).unwrap(), pos, "{what}: sorted rows of the slots");
        assert_eq!(gpu.download(&again.token).unwrap(), token, "{what}: input rows of the sorted rows");
        assert_eq!(gpu.download(&again.tiles).unwrap()[..3 * n], tiles[..], "{what}: tiles");
        eprintln!("{what}: {n} tiles == the host's");
    }
    // Experts past the kernel's block are a clear error.
    let dids = gpu.upload(&[0i32, 1]).unwrap();
    assert!(moe.sort_slots(&dids, 2, 1025).is_err());
    assert!(moe.sort_slots(&dids, 3, 4).is_err(), "2 ids are not rows of top-3");
}

/// Decode attention that prepares its q and k heads itself (PREP in attention/kv.cu) gives the
/// bits of the head preparation's launch followed by the attention, outputs and caches alike,
/// and the CPU's results to the f32 bound: GQA and not, heads of 32 to 512, partial, whole and
/// no rotation, weighted and unweighted norms, both decode forms (wide blocks for one sequence,
/// narrow for rounds); three sequences of different lengths, a prompt (prepared by its own
/// launch in both) then decode steps. A decode batch past the rotation table, or a norm weight
/// of the wrong width, is refused.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_projected_kv_attention_gives_the_composed_bits() {
    use crate::kernels::backend::{HeadOps, ProjectedHeads};
    use crate::kernels::rope::RopeTable;
    let gpu = gpu();
    let cpu = CpuOps;
    let mut rng = rng("cuda_projected_kv_attention_gives_the_composed_bits");
    let up = |v: &[f32]| gpu.upload(v).unwrap();
    for form in [KvForm::DEFAULT, KvForm::BATCHED] {
        let fused = CudaOps::new(gpu.clone(), Precision::F32).unwrap().with_kv_form(form).with_kv_prep(true);
        let composed = CudaOps::new(gpu.clone(), Precision::F32).unwrap().with_kv_form(form).with_kv_prep(false);
        // (q heads, kv heads, head size, rotated channels, weighted norms).
        for &(qh, kvh, hd, rot, weighted) in &[
            (8usize, 2usize, 256usize, 64usize, true),
            (4, 4, 64, 64, false),
            (2, 1, 128, 32, true),
            (6, 3, 32, 0, true),
            (2, 1, 512, 128, true),
        ] {
            let what = format!("{form:?} {qh}/{kvh}×{hd} rot {rot} weighted {weighted}");
            let positions = 64;
            let table = || RopeTable::new(1e6, rot.max(2), positions);
            let (cpu_rope, fused_rope, composed_rope) = (cpu.rope(table()).unwrap(), fused.rope(table()).unwrap(), composed.rope(table()).unwrap());
            let (qw_, kw_) = (rng.vec(hd, 0.5, 1.5), rng.vec(hd, 0.5, 1.5));
            let (qw_f, kw_f, qw_c, kw_c) = (up(&qw_), up(&kw_), up(&qw_), up(&kw_));
            let shape = AttentionShape { q_heads: qh, kv_heads: kvh, hd, scale: (hd as f32).powf(-0.5), max_distance: None };
            let (qw, kw) = (qh * hd, kvh * hd);
            let stride = 2 * qw + 2 * kw;
            macro_rules! heads {
                ($rope:expr, $qn:expr, $kn:expr) => {{
                    let q_prep = HeadOps { heads: qh, hd, norm: Some(weighted.then_some($qn)), eps: 1e-6, rope: (rot > 0).then_some($rope) };
                    let k_prep = HeadOps { heads: kvh, norm: Some(weighted.then_some($kn)), ..q_prep };
                    ProjectedHeads { stride, q: 0, gate: qw, k: 2 * qw, v: 2 * qw + kw, q_prep, k_prep }
                }};
            }
            let mut cpu_caches: Vec<_> = (0..3).map(|_| cpu.kv_cache(kw).unwrap()).collect();
            let mut fused_caches: Vec<_> = (0..3).map(|_| fused.kv_cache(kw).unwrap()).collect();
            let mut composed_caches: Vec<_> = (0..3).map(|_| composed.kv_cache(kw).unwrap()).collect();
            let mut past = vec![0usize; 3];
            for (call, lens) in [[3usize, 40, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]].into_iter().enumerate() {
                let segs = pack(lens);
                let n: usize = lens.iter().sum();
                let y = rng.vec(n * stride, -1.5, 1.5);
                let ids = vec![0u32; n];
                let mut yc = y.clone();
                let mut cc: Vec<_> = cpu_caches.iter_mut().collect();
                let want = cpu.projected_kv_attention(&mut yc, heads!(&cpu_rope, &qw_, &kw_), &cpu.batch_at(&segs, &ids, &past).unwrap(), &mut cc, &shape).unwrap();
                let mut got = Vec::new();
                for (ops, caches, rope, qn, kn) in [(&fused, &mut fused_caches, &fused_rope, &qw_f, &kw_f), (&composed, &mut composed_caches, &composed_rope, &qw_c, &kw_c)] {
                    let batch = ops.batch_at(&segs, &ids, &past).unwrap();
                    for ((c, &p), &l) in caches.iter_mut().zip(&past).zip(&lens) {
                        ops.kv_reserve(c, p, p + l).unwrap();
                    }
                    let mut yg = up(&y);
                    let mut gc: Vec<_> = caches.iter_mut().collect();
                    got.push(gpu.download(&ops.projected_kv_attention(&mut yg, heads!(rope, qn, kn), &batch, &mut gc, &shape).unwrap()).unwrap());
                }
                check(&format!("projected kv_attention {what} call {call}"), &got[0], &want, BOUND);
                assert!(got[0].iter().zip(&got[1]).all(|(a, b)| a.to_bits() == b.to_bits()), "{what} call {call}: prepared in the attention != prepared before it");
                past.iter_mut().zip(lens).for_each(|(p, l)| *p += l);
            }
            // The caches hold the prepared keys, as the CPU's and bit for bit as the composed path's.
            for s in 0..3 {
                let n = past[s] * kw;
                let (fk, ck) = (gpu.download(&fused_caches[s].keys).unwrap(), gpu.download(&composed_caches[s].keys).unwrap());
                assert_eq!(fk[..n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), ck[..n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{what}: sequence {s}'s keys");
                check(&format!("{what}: sequence {s}'s keys against the CPU"), &fk[..n], &cpu_caches[s].keys[..n], BOUND);
                assert_eq!(gpu.download(&fused_caches[s].values).unwrap()[..n], cpu_caches[s].values[..n], "{what}: sequence {s}'s values");
            }
            // A decode step past the rotation table (a cache of as many rows as the table holds
            // positions), and a norm weight of the wrong width, are refused.
            if rot > 0 {
                let mut cache = fused.kv_cache(kw).unwrap();
                fused.kv_reserve(&mut cache, 0, positions).unwrap();
                let mut yp = up(&rng.vec(positions * stride, -1.0, 1.0));
                let prompt = fused.batch_at(&pack([positions]), &vec![0u32; positions], &[0]).unwrap();
                fused.projected_kv_attention(&mut yp, heads!(&fused_rope, &qw_f, &kw_f), &prompt, &mut [&mut cache], &shape).unwrap();
                fused.kv_reserve(&mut cache, positions, positions + 1).unwrap();
                let far = fused.batch_at(&pack([1]), &[0], &[positions]).unwrap();
                let mut yg = up(&rng.vec(stride, -1.0, 1.0));
                let err = fused.projected_kv_attention(&mut yg, heads!(&fused_rope, &qw_f, &kw_f), &far, &mut [&mut cache], &shape).unwrap_err();
                assert!(err.to_string().contains("rope table"), "{what}: past the table: {err}");
                let narrow = up(&qw_[..hd - 2]);
                let mut fresh = fused.kv_cache(kw).unwrap();
                fused.kv_reserve(&mut fresh, 0, 1).unwrap();
                let mut bad = heads!(&fused_rope, &qw_f, &kw_f);
                bad.q_prep.norm = Some(Some(&narrow));
                let near = fused.batch_at(&pack([1]), &[0], &[0]).unwrap();
                let err = fused.projected_kv_attention(&mut yg, bad, &near, &mut [&mut fresh], &shape).unwrap_err();
                assert!(err.to_string().contains("norm weight"), "{what}: a norm weight of {} channels: {err}", hd - 2);
            }
        }
    }
}

/// A step recorded with its buffers from a pool of its own (`StepPool`: no memory nodes in its
/// graph, so a dependent launch gets its programmatic edge between every pair of kernels) gives
/// the same logits, bit for bit, as the step recorded with the stream's allocations, and every
/// recording succeeds. Dense and MoE; f32, bf16 and Q8_0 weights; f32 and bf16 modes; one
/// sequence (pooled), and rounds of two and nine sequences (nine: more rows than the GEMV
/// takes), recorded as captured by default and from the shared rounds pool with
/// `with_step_pool_rounds`; steps replayed from their graphs (the first step of a shape runs
/// plainly, the second records, later ones replay). The pooled models must have recorded with
/// pools (hostcuda models pools of one's own too), rounds only where asked, the other without.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_step_pools_keep_the_bits() {
    let g = gpu();
    let mut rng = rng("cuda_step_pools_keep_the_bits");
    for rel in ["dense-untied", "dense-tied/gguf/dense-tied-f32.gguf", "dense-untied/gguf/dense-untied-q8_0.gguf", "moe/gguf/moe-bf16.gguf"] {
        let path = fixture(rel);
        for precision in [Precision::F32, Precision::Bf16] {
            let load = |pools, rounds| Qwen35::load_on(&path, CudaOps::new(g.clone(), precision).unwrap().with_step_pools(pools).with_step_pool_rounds(rounds)).unwrap();
            let (stream, pooled, rounds) = (load(false, false), load(true, false), load(true, true));
            let vocab = stream.cfg.vocab_size as u32;
            let lens = [20usize, 7, 3, 12, 1, 5, 9, 2, 16];
            let prompts: Vec<Vec<u32>> = lens.iter().map(|&n| (0..n).map(|_| rng.next_u32() % vocab).collect()).collect();
            for sequences in [1usize, 2, 9] {
                let mut a: Vec<_> = (0..sequences).map(|_| stream.new_state().unwrap()).collect();
                let mut b: Vec<_> = (0..sequences).map(|_| pooled.new_state().unwrap()).collect();
                let mut c: Vec<_> = (0..sequences).map(|_| rounds.new_state().unwrap()).collect();
                let mut feeds: Vec<Vec<u32>> = prompts[..sequences].to_vec();
                for t in 0..6 {
                    let mut batch_a: Vec<(&[u32], &mut Qwen35State<CudaOps>)> = feeds.iter().map(|f| f.as_slice()).zip(a.iter_mut()).collect();
                    let want = stream.forward_batch(&mut batch_a).unwrap();
                    for (m, states, what) in [(&pooled, &mut b, "pooled"), (&rounds, &mut c, "rounds-pooled")] {
                        let mut batch: Vec<(&[u32], &mut Qwen35State<CudaOps>)> = feeds.iter().map(|f| f.as_slice()).zip(states.iter_mut()).collect();
                        let got = m.forward_batch(&mut batch).unwrap();
                        for (s, (w, gl)) in want.iter().zip(&got).enumerate() {
                            assert!(
                                w.iter().zip(gl).all(|(x, y)| x.to_bits() == y.to_bits()),
                                "{rel} {precision:?}, {sequences} sequence(s), step {t}, sequence {s}: the {what} step's logits differ"
                            );
                        }
                    }
                    feeds = want.iter().map(|l| vec![argmax(l) as u32]).collect();
                }
            }
            for m in [&stream, &pooled, &rounds] {
                let (recorded, failed) = m.ops().graph_stats();
                assert!(failed.is_empty() && recorded > 0, "{rel} {precision:?}: recordings {recorded}, failed {failed:?}");
            }
            assert!(stream.ops().pooled_graph_summaries().is_empty(), "{rel} {precision:?}: pools off, yet a recording took one");
            let (one, all) = (pooled.ops().pooled_graph_summaries(), rounds.ops().pooled_graph_summaries());
            assert!(!one.is_empty(), "{rel} {precision:?}: no recording took a pool");
            // One sequence's steps (a shape each) pooled by both, the rounds of 2 and 9 by the
            // second alone.
            assert_eq!(all.len(), one.len() + 2, "{rel} {precision:?}: pooled recordings, rounds pooled or not");
            // What a pool is for: no memory node in the step's graph, so that every kernel can
            // follow the kernel before it through a programmatic edge.
            for summary in one.into_iter().chain(all) {
                let s = summary.unwrap_or_else(|e| panic!("{rel} {precision:?}: {e}"));
                assert!(!s.nodes.contains_key("mem_alloc") && !s.nodes.contains_key("mem_free"), "{rel} {precision:?}: a pooled step's graph holds memory nodes: {s}");
                assert!(s.edges.keys().any(|k| k.starts_with("kernel->kernel:type1")), "{rel} {precision:?}: no programmatic kernel edge: {s}");
            }
            eprintln!("{rel} {precision:?}: 6 steps of 1, 2 and 9 sequences, pooled (rounds too, or not) == stream-allocated");
        }
    }
}
