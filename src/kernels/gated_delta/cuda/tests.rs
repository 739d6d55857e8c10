//! Device tests: every CUDA kernel of the family against its CPU twin, on fresh random inputs
//! (the seed is printed, so a failure can be replayed with TERN_TEST_SEED), several shapes,
//! outputs poisoned with NaN before each launch (an unwritten element then fails the
//! comparison, and so does any NaN the kernel makes). They need a GPU and are ignored
//! elsewhere; scripts/device-test.sh runs them with `--ignored`.


use super::*;
use crate::cuda::test_util::{check, gpu, left_to_the_gpu, nan, rng};
use crate::kernels::gated_delta::recurrence::tests::Operands;
use crate::kernels::gated_delta::test_util::{assert_bits_eq, rel_err, Lcg};
use crate::kernels::gated_delta as cpu;
use crate::kernels::pack;

const BOUND: f64 = 1e-5;

/// Slots for `n` sequences scattered over a pool of `2n + 1`, so a kernel that ignored the
/// slot table would read and write the wrong states.
fn scattered_slots(n: usize) -> Vec<usize> {
    (0..n).map(|s| (2 * s + 1) % (2 * n + 1)).collect()
}

/// The fast prepare pass's shared memory: the sizes chunked_tc.cu asserts for its layouts, and
/// the blocks a multiprocessor of the H200 (228 KB, 1 KB of it reserved per block) then holds:
/// two in the wide layout, three in the compact one, at every head size compiled.
#[test]
fn fast_prepare_layouts_fit_their_blocks() {
    assert_eq!(tc_prepare_smem(128, 128, false), 108_544);
    assert_eq!(tc_prepare_smem(128, 128, true), 72_704);
    assert_eq!(tc_prepare_smem(64, 64, true), 56_320);
    let per_sm = 228 * 1024;
    for dk in FAST_CHUNK_HEAD_DIMS {
        for dv in FAST_CHUNK_HEAD_DIMS {
            let (wide, compact) = (tc_prepare_smem(dk, dv, false), tc_prepare_smem(dk, dv, true));
            assert!(2 * (wide + 1024) <= per_sm, "wide {dk}x{dv}: {wide} bytes");
            assert!(3 * (compact + 1024) <= per_sm, "compact {dk}x{dv}: {compact} bytes");
        }
    }
}

/// How many segments the state pass cuts a sequence into: enough to fill the multiprocessors
/// (132 on an H100: Qwen3.5-35B-A3B's 64 blocks of 64 rows give 2, its 128 of 32 rows 1),
/// never more than 16 nor than leave a segment under 8 chunks, and what a test asks within
/// those bounds.
#[test]
fn state_segments_fill_the_device_within_bounds() {
    assert_eq!(state_segment_count(None, 132, 64, 512), 2);
    assert_eq!(state_segment_count(None, 132, 128, 512), 1);
    assert_eq!(state_segment_count(None, 132, 32, 512), 4);
    assert_eq!(state_segment_count(None, 132, 200, 512), 1);
    assert_eq!(state_segment_count(None, 132, 1, 100_000), 16);
    assert_eq!(state_segment_count(None, 132, 32, 20), 2);
    assert_eq!(state_segment_count(None, 132, 32, 7), 1);
    assert_eq!(state_segment_count(None, 132, 0, 512), 16);
    assert_eq!(state_segment_count(Some(16), 0, 64, 24), 3);
    assert_eq!(state_segment_count(Some(2), 0, 64, 24), 2);
    assert_eq!(state_segment_count(Some(3), 0, 64, 7), 1);
}

/// The host's fewest chunks a segment is the kernel's, which cuts each sequence by it.
#[test]
fn state_segment_minimum_is_the_kernels() {
    let decl = format!("constexpr int tern_gdn_tc_seg_min = {STATE_SEGMENT_MIN_CHUNKS};");
    assert!(CHUNKED_TC.code.contains(&decl), "chunked_tc.cu must declare `{decl}`");
}

/// The fast state pass's shared memory: the sizes chunked_tc.cu asserts, and one block a
/// multiprocessor (227 KB at most a block) with three stages, in clusters (two barriers a stage
/// more) or not, and in the warpgroup form.
#[test]
fn fast_state_layouts_fit_a_multiprocessor() {
    assert_eq!(tc_state_smem(128, 3, false), 203_776);
    assert_eq!(tc_state_smem(128, 3, true), 203_824);
    assert_eq!(tc_state_smem(64, 3, true), 126_000);
    assert_eq!(tc_state_wg_smem(32), 202_288);
    assert_eq!(tc_state_wg_smem(64), 230_960);
    assert_eq!(tc_state_t_smem(), 198_144);
    assert!(tc_state_wg_smem(64) <= 227 * 1024);
    for dk in FAST_CHUNK_HEAD_DIMS {
        for cluster in [false, true] {
            let bytes = tc_state_smem(dk, 3, cluster);
            assert!(bytes <= 227 * 1024, "d_k {dk}, clusters {cluster}: {bytes} bytes");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_gates_match_cpu() {
    let gpu = gpu();
    let k = GatedDeltaCuda::new(gpu.clone()).unwrap();
    let mut rng = rng("cuda_gates_match_cpu");
    for &(rows, heads) in &[(1usize, 32usize), (7, 48), (4096, 32), (3, 1)] {
        let alpha = rng.vec(rows * heads, -40.0, 40.0);
        let b = rng.vec(rows * heads, -30.0, 30.0);
        let dt = rng.vec(heads, -2.0, 2.0);
        let a: Vec<f32> = (0..heads).map(|_| -rng.range(-3.0, 2.0).exp()).collect();
        let (mut g_cpu, mut beta_cpu) = (vec![0.0; alpha.len()], vec![0.0; alpha.len()]);
        cpu::decay_gate(&alpha, &dt, &a, &mut g_cpu).unwrap();
        cpu::beta_gate(&b, &mut beta_cpu).unwrap();
        let (mut g, mut beta) = (nan(&gpu, alpha.len()), nan(&gpu, alpha.len()));
        let (da, db, ddt, daa) = (gpu.upload(&alpha).unwrap(), gpu.upload(&b).unwrap(), gpu.upload(&dt).unwrap(), gpu.upload(&a).unwrap());
        k.gates(&da, &db, &ddt, &daa, &mut g, &mut beta).unwrap();
        let eg = check("g", &gpu.download(&g).unwrap(), &g_cpu, BOUND);
        let eb = check("beta", &gpu.download(&beta).unwrap(), &beta_cpu, BOUND);
        eprintln!("gates rows {rows} heads {heads}: g {eg:.2e}, beta {eb:.2e}");
    }
    // Bad shapes are errors, not launches.
    let (x, mut y, mut z) = (gpu.upload(&[0.0f32; 6]).unwrap(), nan(&gpu, 6), nan(&gpu, 6));
    let four = gpu.upload(&[0.0f32; 4]).unwrap();
    assert!(matches!(k.gates(&x, &x, &four, &four, &mut y, &mut z), Err(Error::Shape(_))));
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_conv_matches_cpu_and_scan_equals_steps() {
    let gpu = gpu();
    let k = GatedDeltaCuda::new(gpu.clone()).unwrap();
    let mut rng = rng("cuda_conv_matches_cpu_and_scan_equals_steps");
    for &(channels, kw) in &[(8192usize, 4usize), (300, 4), (40, 2), (17, 1), (64, 5), (96, 8)] {
        let taps = kw - 1;
        // 64 and 65 sit on the kernel's chunk of positions; 300 spans several chunks.
        let lengths = [13usize, 1, 0, 6, 300, 64, 65];
        let n = lengths.len();
        let segments = pack(lengths);
        let tokens: usize = lengths.iter().sum();
        let slots = scattered_slots(n);
        let x = rng.vec(tokens * channels, -3.0, 3.0);
        let w = rng.vec(channels * kw, -1.0, 1.0);
        let pool = rng.vec((2 * n + 1) * channels * taps, -2.0, 2.0);

        // CPU reference on the pool's slots.
        let mut cpu_pool = pool.clone();
        let mut cpu_out = vec![f32::NAN; x.len()];
        {
            let per = channels * taps;
            let mut states: Vec<Vec<f32>> = slots.iter().map(|&s| cpu_pool[s * per..(s + 1) * per].to_vec()).collect();
            let mut refs: Vec<&mut [f32]> = states.iter_mut().map(|v| &mut v[..]).collect();
            cpu::conv1d_silu_scan(&x, &segments, &w, kw, &mut refs, &mut cpu_out).unwrap();
            for (i, &s) in slots.iter().enumerate() {
                cpu_pool[s * per..(s + 1) * per].copy_from_slice(&states[i]);
            }
        }

        let segs = GpuSegments::new(&gpu, &segments, &slots, tokens).unwrap();
        let (dx, dw) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap());
        let mut dpool = gpu.upload(&pool).unwrap();
        let mut dout = nan(&gpu, x.len());
        k.conv1d_silu(&dx, &dw, kw, &segs, GpuStates::Pool(&mut dpool), &mut dout).unwrap();
        let scan_out = gpu.download(&dout).unwrap();
        let scan_pool = gpu.download(&dpool).unwrap();
        let eo = check("conv output", &scan_out, &cpu_out, BOUND);
        // The state holds raw inputs: exactly the CPU's values, and untouched slots unchanged.
        assert_bits_eq("conv states", &scan_pool, &cpu_pool);

        // Each sequence's state in a buffer of its own (an address table): the same bits.
        let per = channels * taps;
        if per > 0 {
            let mut own: Vec<CudaSlice<f32>> = slots.iter().map(|&s| gpu.upload(&pool[s * per..(s + 1) * per]).unwrap()).collect();
            let mut refs: Vec<&mut CudaSlice<f32>> = own.iter_mut().collect();
            let mut o = nan(&gpu, x.len());
            k.conv1d_silu(&dx, &dw, kw, &segs, GpuStates::Each(&mut refs), &mut o).unwrap();
            assert_bits_eq("conv, own state buffers (outputs)", &gpu.download(&o).unwrap(), &scan_out);
            for (i, &s) in slots.iter().enumerate() {
                assert_bits_eq("conv, own state buffers (states)", &gpu.download(&own[i]).unwrap(), &cpu_pool[s * per..(s + 1) * per]);
            }
        }

        // Decode: every position through one-token launches, sequences batched per step.
        let mut dpool = gpu.upload(&pool).unwrap();
        let mut step_out = vec![f32::NAN; x.len()];
        for p in 0..*lengths.iter().max().unwrap() {
            let active: Vec<usize> = (0..n).filter(|&s| p < lengths[s]).collect();
            let xs: Vec<f32> = active.iter().flat_map(|&s| x[(segments[s].start + p) * channels..][..channels].iter().copied()).collect();
            let step_slots: Vec<usize> = active.iter().map(|&s| slots[s]).collect();
            let segs = GpuSegments::decode(&gpu, &step_slots).unwrap();
            let mut o = nan(&gpu, xs.len());
            k.conv1d_silu(&gpu.upload(&xs).unwrap(), &dw, kw, &segs, GpuStates::Pool(&mut dpool), &mut o).unwrap();
            let o = gpu.download(&o).unwrap();
            for (i, &s) in active.iter().enumerate() {
                step_out[(segments[s].start + p) * channels..][..channels].copy_from_slice(&o[i * channels..(i + 1) * channels]);
            }
        }
        assert_bits_eq("conv steps vs scan (outputs)", &step_out, &scan_out);
        assert_bits_eq("conv steps vs scan (states)", &gpu.download(&dpool).unwrap(), &scan_pool);
        eprintln!("conv channels {channels} K {kw}: output {eo:.2e}; states exact; steps == scan");
    }
    let segs = GpuSegments::new(&gpu, &pack([2]), &[0], 2).unwrap();
    let (x, w) = (gpu.upload(&[0.0f32; 16]).unwrap(), gpu.upload(&[0.0f32; 32]).unwrap());
    let (mut st, mut out) = (nan(&gpu, 8 * 3), nan(&gpu, 16));
    assert!(matches!(k.conv1d_silu(&x, &w, 9, &segs, GpuStates::Pool(&mut st), &mut out), Err(Error::Shape(_))));
    let mut short = nan(&gpu, 20);
    assert!(matches!(k.conv1d_silu(&x, &w, 4, &segs, GpuStates::Pool(&mut short), &mut out), Err(Error::Shape(_))));
    assert!(matches!(GpuSegments::new(&gpu, &pack([1, 1]), &[3, 3], 2), Err(Error::Shape(_))));
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_norms_match_cpu() {
    let gpu = gpu();
    let k = GatedDeltaCuda::new(gpu.clone()).unwrap();
    let mut rng = rng("cuda_norms_match_cpu");
    for &(rows, d) in &[(1usize, 64usize), (33, 128), (4096, 128), (5, 256), (7, 48)] {
        let (q0, k0) = (rng.vec(rows * d, -2.0, 2.0), rng.vec(rows * d, -2.0, 2.0));
        let (mut q, mut kk) = (q0.clone(), k0.clone());
        cpu::normalize_qk(&mut q, &mut kk, d).unwrap();
        let (mut dq, mut dk) = (gpu.upload(&q0).unwrap(), gpu.upload(&k0).unwrap());
        k.normalize_qk(&mut dq, &mut dk, d).unwrap();
        let eq = check("q", &gpu.download(&dq).unwrap(), &q, BOUND);
        let ek = check("k", &gpu.download(&dk).unwrap(), &kk, BOUND);

        let y = rng.vec(rows * d, -3.0, 3.0);
        let z = rng.vec(rows * d, -8.0, 8.0);
        let w = rng.vec(d, 0.5, 1.5);
        let mut want = vec![f32::NAN; y.len()];
        cpu::gated_rms_norm(&y, &z, &w, 1e-6, &mut want).unwrap();
        let mut out = nan(&gpu, y.len());
        k.gated_rms_norm(&gpu.upload(&y).unwrap(), &gpu.upload(&z).unwrap(), &gpu.upload(&w).unwrap(), 1e-6, &mut out).unwrap();
        let en = check("gated norm", &gpu.download(&out).unwrap(), &want, BOUND);
        eprintln!("norms rows {rows} d {d}: q {eq:.2e}, k {ek:.2e}, gated {en:.2e}");
    }
}

/// One recurrence case: CPU scan vs the device launcher, from non-zero states in scattered
/// slots, pre-normalised q/k in separate buffers or raw q/k/v inside one fused
/// `[tokens][q | k | v]` buffer with in-kernel normalisation. Returns (output, state) errors.
/// A case's size for [`left_to_the_gpu`]: tokens × value heads × d_k × d_v.
fn case_work(heads: &DeltaRuleHeads, lengths: &[usize]) -> usize {
    lengths.iter().sum::<usize>() * heads.n_v_heads * heads.d_k * heads.d_v
}

fn recurrence_case(k: &GatedDeltaCuda, rng: &mut Lcg, heads: &DeltaRuleHeads, lengths: &[usize], fused: bool) -> (f64, f64) {
    device_vs_cpu_scan(k, rng, heads, lengths, fused, Path::Scan, BOUND)
}

/// Which device form of the delta rule a test runs.
#[derive(Clone, Copy, Debug)]
enum Path {
    Scan,
    Chunked(ChunkAccumulate),
    /// The tensor-core fast mode; the f32 operands' decays drawn weak (g in [lo, hi]) when given.
    Fast(Option<(f32, f32)>),
}

/// The CPU sequential scan of every sequence from its state in `pool` (sequence i's at slot
/// `slots[i]`): every token's output, and the pool as the scan leaves it.
fn scan_on_cpu(heads: &DeltaRuleHeads, x: &Operands, segments: &[Segment], slots: &[usize], pool: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let sl = heads.state_len();
    let tokens: usize = segments.iter().map(|s| s.len).sum();
    let mut want_pool = pool.to_vec();
    let mut want_out = vec![f32::NAN; tokens * heads.n_v_heads * heads.d_v];
    let mut states: Vec<Vec<f32>> = slots.iter().map(|&s| pool[s * sl..(s + 1) * sl].to_vec()).collect();
    let mut refs: Vec<&mut [f32]> = states.iter_mut().map(|v| &mut v[..]).collect();
    cpu::delta_rule_scan(heads, x.inputs(), segments, &mut refs, &mut want_out).unwrap();
    for (i, &s) in slots.iter().enumerate() {
        want_pool[s * sl..(s + 1) * sl].copy_from_slice(&states[i]);
    }
    (want_out, want_pool)
}

/// CPU sequential scan vs the device recurrence, the device chunked prefill with the given
/// accumulator, or its fast mode; asserts `bound` on every sequence's output and state.
fn device_vs_cpu_scan(
    k: &GatedDeltaCuda,
    rng: &mut Lcg,
    heads: &DeltaRuleHeads,
    lengths: &[usize],
    fused: bool,
    path: Path,
    bound: f64,
) -> (f64, f64) {
    let gpu = k.gpu().clone();
    let n = lengths.len();
    let segments = pack(lengths.iter().copied());
    let tokens: usize = lengths.iter().sum();
    let slots = scattered_slots(n);
    let (qk_row, v_row, sl) = (heads.n_k_heads * heads.d_k, heads.n_v_heads * heads.d_v, heads.state_len());
    let mut x = Operands::random(rng, heads, tokens);
    if let Path::Fast(Some((lo, hi))) = path {
        x.g = rng.vec(x.g.len(), lo, hi);
    }
    let (raw_q, raw_k) = (rng.vec(tokens * qk_row, -1.0, 1.0), rng.vec(tokens * qk_row, -1.0, 1.0));
    if fused {
        x.q = raw_q.clone();
        x.k = raw_k.clone();
        cpu::normalize_qk(&mut x.q, &mut x.k, heads.d_k).unwrap();
    }
    let pool = rng.vec((2 * n + 1) * sl, -0.5, 0.5);
    let (want_out, want_pool) = scan_on_cpu(heads, &x, &segments, &slots, &pool);

    let segs = GpuSegments::new(&gpu, &segments, &slots, tokens).unwrap();
    let (dg, db) = (gpu.upload(&x.g).unwrap(), gpu.upload(&x.beta).unwrap());
    let mut dpool = gpu.upload(&pool).unwrap();
    let mut dout = nan(&gpu, tokens * v_row);
    if fused {
        let row = 2 * qk_row + v_row;
        let mut qkv = Vec::with_capacity(tokens * row);
        for t in 0..tokens {
            qkv.extend_from_slice(&raw_q[t * qk_row..(t + 1) * qk_row]);
            qkv.extend_from_slice(&raw_k[t * qk_row..(t + 1) * qk_row]);
            qkv.extend_from_slice(&x.v[t * v_row..(t + 1) * v_row]);
        }
        let buf = gpu.upload(&qkv).unwrap();
        let inputs = GpuDeltaRuleInputs {
            q: Rows { buf: &buf, offset: 0, stride: row },
            k: Rows { buf: &buf, offset: qk_row, stride: row },
            v: Rows { buf: &buf, offset: 2 * qk_row, stride: row },
            g: &dg,
            beta: &db,
            normalize_qk: true,
            fused: None,
        };
        run_path(k, path, heads, &inputs, &segs, &mut dpool, &mut dout);
    } else {
        let (dq, dk, dv) = (gpu.upload(&x.q).unwrap(), gpu.upload(&x.k).unwrap(), gpu.upload(&x.v).unwrap());
        let inputs = GpuDeltaRuleInputs {
            q: Rows::contiguous(&dq, qk_row),
            k: Rows::contiguous(&dk, qk_row),
            v: Rows::contiguous(&dv, v_row),
            g: &dg,
            beta: &db,
            normalize_qk: false,
            fused: None,
        };
        run_path(k, path, heads, &inputs, &segs, &mut dpool, &mut dout);
    }
    let got_out = gpu.download(&dout).unwrap();
    let got_pool = gpu.download(&dpool).unwrap();
    let (mut eo, mut es) = (0.0f64, 0.0f64);
    for (s, seg) in segments.iter().enumerate() {
        let o = seg.start * v_row..(seg.start + seg.len) * v_row;
        eo = eo.max(check(&format!("{heads:?} {lengths:?} seq {s} output"), &got_out[o.clone()], &want_out[o], bound));
        let st = slots[s] * sl..(slots[s] + 1) * sl;
        es = es.max(check(&format!("{heads:?} {lengths:?} seq {s} state"), &got_pool[st.clone()], &want_pool[st], bound));
    }
    // Slots no sequence owns are untouched.
    for slot in (0..2 * n + 1).filter(|s| !slots.contains(s)) {
        assert_bits_eq("unused state slot", &got_pool[slot * sl..(slot + 1) * sl], &pool[slot * sl..(slot + 1) * sl]);
    }
    (eo, es)
}

fn run_path(k: &GatedDeltaCuda, path: Path, heads: &DeltaRuleHeads, x: &GpuDeltaRuleInputs, segs: &GpuSegments, pool: &mut CudaSlice<f32>, out: &mut CudaSlice<f32>) {
    match path {
        Path::Scan => k.delta_rule(heads, x, segs, GpuStates::Pool(pool), out).unwrap(),
        Path::Chunked(acc) => k.delta_rule_chunked(heads, x, segs, GpuStates::Pool(pool), out, acc).unwrap(),
        Path::Fast(_) => k.delta_rule_chunked_fast(heads, x, segs, GpuStates::Pool(pool), out).unwrap(),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_recurrence_matches_cpu_scan() {
    let gpu = gpu();
    let k = GatedDeltaCuda::new(gpu.clone()).unwrap();
    let mut rng = rng("cuda_recurrence_matches_cpu_scan");
    use KeyHeadMap::{Grouped, Tiled};
    let cases: &[(usize, usize, usize, usize, KeyHeadMap, &[usize])] = &[
        (2, 4, 64, 64, Grouped, &[1, 7, 64, 65, 300]),
        (2, 6, 128, 128, Tiled, &[1, 200, 4096]),
        (1, 2, 256, 256, Grouped, &[33, 1000]),
        (2, 4, 256, 256, Tiled, &[2, 130]),
        (16, 32, 128, 128, Grouped, &[1, 2, 100]),
        (16, 32, 128, 128, Tiled, &[17]),
        (2, 4, 128, 64, Grouped, &[50, 3]),
        (1, 3, 32, 48, Tiled, &[5, 40]),
    ];
    for &(nk, nv, dk, dv, key_head, lengths) in cases {
        let heads = DeltaRuleHeads { n_k_heads: nk, n_v_heads: nv, d_k: dk, d_v: dv, key_head };
        if left_to_the_gpu(&gpu, &format!("{heads:?} {lengths:?}"), case_work(&heads, lengths)) {
            continue;
        }
        for fused in [false, true] {
            let (eo, es) = recurrence_case(&k, &mut rng, &heads, lengths, fused);
            eprintln!("recurrence nk {nk} nv {nv} dk {dk} dv {dv} {key_head:?} {lengths:?} fused {fused}: output {eo:.2e}, state {es:.2e}");
        }
    }
    // d_k the kernel has no registers for is a clear error.
    let heads = DeltaRuleHeads { n_k_heads: 1, n_v_heads: 1, d_k: 48, d_v: 48, key_head: Grouped };
    let segs = GpuSegments::new(&gpu, &pack([1]), &[0], 1).unwrap();
    let b = nan(&gpu, 48);
    let one = nan(&gpu, 1);
    let mut st = nan(&gpu, 48 * 48);
    let mut out = nan(&gpu, 48);
    let x = GpuDeltaRuleInputs { q: Rows::contiguous(&b, 48), k: Rows::contiguous(&b, 48), v: Rows::contiguous(&b, 48), g: &one, beta: &one, normalize_qk: false, fused: None };
    assert!(matches!(k.delta_rule(&heads, &x, &segs, GpuStates::Pool(&mut st), &mut out), Err(Error::Shape(_))));
}

/// On the device too, n decode steps and one scan of n tokens agree bit for bit (outputs and
/// states), with sequences of different lengths dropping out of the decode batch.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_recurrence_scan_equals_decode_steps_bit_for_bit() {
    let gpu = gpu();
    // The butterflies' form, against which the scatter sums are checked.
    let mut k = GatedDeltaCuda::new(gpu.clone()).unwrap();
    k.set_scatter_sums(ScatterSums::Off);
    let mut ks = GatedDeltaCuda::new(gpu.clone()).unwrap();
    ks.set_scatter_sums(ScatterSums::On);
    let mut rng = rng("cuda_recurrence_scan_equals_decode_steps_bit_for_bit");
    let cases = [(16usize, 32usize, 128usize, 128usize, KeyHeadMap::Grouped), (2, 4, 64, 64, KeyHeadMap::Tiled), (1, 2, 256, 256, KeyHeadMap::Grouped), (2, 6, 128, 44, KeyHeadMap::Tiled)];
    for (case, &(nk, nv, d, d_v, key_head)) in cases.iter().enumerate() {
        let heads = DeltaRuleHeads { n_k_heads: nk, n_v_heads: nv, d_k: d, d_v, key_head };
        // Raw q/k normalised in the kernel in every other case.
        let normalize_qk = case % 2 == 1;
        let lengths = [9usize, 4, 12];
        let n = lengths.len();
        let segments = pack(lengths);
        let tokens: usize = lengths.iter().sum();
        let slots = scattered_slots(n);
        let (qk_row, v_row, sl) = (nk * d, nv * d_v, heads.state_len());
        let x = Operands::random(&mut rng, &heads, tokens);
        let pool = rng.vec((2 * n + 1) * sl, -0.5, 0.5);
        let up = |v: &[f32]| gpu.upload(v).unwrap();

        let segs = GpuSegments::new(&gpu, &segments, &slots, tokens).unwrap();
        let (dq, dk, dv, dg, db) = (up(&x.q), up(&x.k), up(&x.v), up(&x.g), up(&x.beta));
        let mut scan_pool = up(&pool);
        let mut scan_out = nan(&gpu, tokens * v_row);
        let inputs = GpuDeltaRuleInputs { q: Rows::contiguous(&dq, qk_row), k: Rows::contiguous(&dk, qk_row), v: Rows::contiguous(&dv, v_row), g: &dg, beta: &db, normalize_qk, fused: None };
        k.delta_rule(&heads, &inputs, &segs, GpuStates::Pool(&mut scan_pool), &mut scan_out).unwrap();
        let scan_out = gpu.download(&scan_out).unwrap();
        let scan_pool = gpu.download(&scan_pool).unwrap();

        // The steps on the pool and on per-sequence buffers (an address table), and on the pool
        // with the scatter sums (`ks`); then on a pool where sequence s is in slot s (`dense`:
        // a step's slots are consecutive when its sequences are, which the kernel then computes
        // instead of loading, from a first slot of 0 or 2), and on the scattered pool with every
        // slot and row loaded from the tables (`kt`).
        let mut kt = GatedDeltaCuda::new(gpu.clone()).unwrap();
        kt.set_scatter_sums(ScatterSums::Off);
        kt.set_direct_addressing(false);
        // And with each step's first state rows requested before it awaits the kernel before
        // it (`ke`, EARLY_STATE), on per-sequence buffers and on the pool.
        let mut ke = GatedDeltaCuda::new(gpu.clone()).unwrap();
        ke.set_scatter_sums(ScatterSums::Off);
        ke.set_early_state(true);
        let dense_pool: Vec<f32> = slots.iter().flat_map(|&s| pool[s * sl..(s + 1) * sl].iter().copied()).collect();
        for (own_buffers, dense, kd) in [(false, false, &k), (true, false, &k), (false, false, &ks), (false, true, &k), (false, false, &kt), (true, false, &ke), (false, false, &ke)] {
            let mut step_pool = up(if dense { &dense_pool } else { &pool });
            let mut own: Vec<CudaSlice<f32>> = slots.iter().map(|&s| up(&pool[s * sl..(s + 1) * sl])).collect();
            let mut step_out = vec![f32::NAN; tokens * v_row];
            for p in 0..*lengths.iter().max().unwrap() {
                let active: Vec<usize> = (0..n).filter(|&s| p < lengths[s]).collect();
                let rows: Vec<usize> = active.iter().map(|&s| segments[s].start + p).collect();
                let gather = |v: &[f32], w: usize| rows.iter().flat_map(|&t| v[t * w..(t + 1) * w].iter().copied()).collect::<Vec<f32>>();
                let (sq, sk, sv, sg, sb) = (up(&gather(&x.q, qk_row)), up(&gather(&x.k, qk_row)), up(&gather(&x.v, v_row)), up(&gather(&x.g, nv)), up(&gather(&x.beta, nv)));
                let mut o = nan(&gpu, rows.len() * v_row);
                let inputs = GpuDeltaRuleInputs { q: Rows::contiguous(&sq, qk_row), k: Rows::contiguous(&sk, qk_row), v: Rows::contiguous(&sv, v_row), g: &sg, beta: &sb, normalize_qk, fused: None };
                if own_buffers {
                    let segs = GpuSegments::decode(&gpu, &(0..active.len()).collect::<Vec<_>>()).unwrap();
                    let mut refs: Vec<&mut CudaSlice<f32>> = own.iter_mut().enumerate().filter(|(s, _)| active.contains(s)).map(|(_, b)| b).collect();
                    kd.delta_rule(&heads, &inputs, &segs, GpuStates::Each(&mut refs), &mut o).unwrap();
                } else {
                    let step_slots: Vec<usize> = active.iter().map(|&s| if dense { s } else { slots[s] }).collect();
                    let segs = GpuSegments::decode(&gpu, &step_slots).unwrap();
                    kd.delta_rule(&heads, &inputs, &segs, GpuStates::Pool(&mut step_pool), &mut o).unwrap();
                }
                let o = gpu.download(&o).unwrap();
                for (i, &t) in rows.iter().enumerate() {
                    step_out[t * v_row..(t + 1) * v_row].copy_from_slice(&o[i * v_row..(i + 1) * v_row]);
                }
            }
            let how = format!(
                "decode steps{}{}{}{} vs scan",
                if own_buffers { " (own buffers)" } else { "" },
                if dense { " (dense pool)" } else { "" },
                if std::ptr::eq(kd, &ks) { " with scatter sums" } else { "" },
                if std::ptr::eq(kd, &kt) { " (tables loaded)" } else if std::ptr::eq(kd, &ke) { " (early state)" } else { "" }
            );
            assert_bits_eq(&format!("{how} (outputs)"), &step_out, &scan_out);
            if own_buffers {
                for (i, &s) in slots.iter().enumerate() {
                    assert_bits_eq(&format!("{how} (states)"), &gpu.download(&own[i]).unwrap(), &scan_pool[s * sl..(s + 1) * sl]);
                }
            } else if dense {
                let got = gpu.download(&step_pool).unwrap();
                for (i, &s) in slots.iter().enumerate() {
                    assert_bits_eq(&format!("{how} (states)"), &got[i * sl..(i + 1) * sl], &scan_pool[s * sl..(s + 1) * sl]);
                }
            } else {
                assert_bits_eq(&format!("{how} (states)"), &gpu.download(&step_pool).unwrap(), &scan_pool);
            }
        }
        // Every rows-per-warp variant, in blocks of every size, computes the same bits.
        // The butterflies' form, against which the scatter sums are checked.
        let mut kr = GatedDeltaCuda::new(gpu.clone()).unwrap();
        kr.set_scatter_sums(ScatterSums::Off);
        for rows in RECURRENCE_VARIANTS {
            for warps in RECURRENCE_BLOCK_WARP_CHOICES {
                kr.set_recurrence_variant(Some(rows)).unwrap();
                kr.set_recurrence_block_warps(warps).unwrap();
                let mut p = up(&pool);
                let mut o = nan(&gpu, tokens * v_row);
                kr.delta_rule(&heads, &inputs, &segs, GpuStates::Pool(&mut p), &mut o).unwrap();
                assert_bits_eq(&format!("variant {rows:?}, {warps} warps a block (outputs)"), &gpu.download(&o).unwrap(), &scan_out);
                assert_bits_eq(&format!("variant {rows:?}, {warps} warps a block (states)"), &gpu.download(&p).unwrap(), &scan_pool);
            }
        }
        // The scatter sums of the 8-row forms as a scan (as decode steps above), the same bits.
        kr.set_recurrence_block_warps(RECURRENCE_BLOCK_WARPS).unwrap();
        for (rows, how) in [((8, 1), ScatterSums::On), ((8, 2), ScatterSums::On), ((8, 1), ScatterSums::Registers64)] {
            kr.set_scatter_sums(how);
            kr.set_recurrence_variant(Some(rows)).unwrap();
            let mut p = up(&pool);
            let mut o = nan(&gpu, tokens * v_row);
            kr.delta_rule(&heads, &inputs, &segs, GpuStates::Pool(&mut p), &mut o).unwrap();
            assert_bits_eq(&format!("variant {rows:?} with scatter sums {how:?} (outputs)"), &gpu.download(&o).unwrap(), &scan_out);
            assert_bits_eq(&format!("variant {rows:?} with scatter sums {how:?} (states)"), &gpu.download(&p).unwrap(), &scan_pool);
        }
        eprintln!("recurrence nk {nk} nv {nv} dk {d} dv {d_v} {key_head:?} l2qk {normalize_qk}: {tokens} decode steps == scan, bit for bit");
    }
}

/// The chunked prefill on the device against the CPU sequential scan (its oracle): lengths
/// around the chunk size up to 4096, several sequences with scattered state slots, both key-head
/// maps, pre-normalised and fused raw q/k, both accumulators. Every error is printed before the
/// bound is asserted, so one run reports all of them.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_chunked_matches_cpu_scan() {
    let gpu = gpu();
    let k = GatedDeltaCuda::new(gpu.clone()).unwrap();
    let mut rng = rng("cuda_chunked_matches_cpu_scan");
    use KeyHeadMap::{Grouped, Tiled};
    let cases: &[(usize, usize, usize, usize, KeyHeadMap, &[usize])] = &[
        (2, 4, 64, 64, Grouped, &[1, 2, 63, 64, 65]),
        (2, 6, 128, 128, Tiled, &[127, 128, 300]),
        (16, 32, 128, 128, Grouped, &[1, 100, 4096]),
        (1, 2, 256, 256, Grouped, &[65, 1000]),
        (2, 4, 128, 64, Tiled, &[70, 5]),
        (1, 3, 32, 48, Grouped, &[200]),
    ];
    let mut failures = Vec::new();
    for acc in [ChunkAccumulate::F64, ChunkAccumulate::F32] {
        let mut worst = (0.0f64, 0.0f64);
        for &(nk, nv, dk, dv, key_head, lengths) in cases {
            let heads = DeltaRuleHeads { n_k_heads: nk, n_v_heads: nv, d_k: dk, d_v: dv, key_head };
            if left_to_the_gpu(&gpu, &format!("{heads:?} {lengths:?}"), case_work(&heads, lengths)) {
                continue;
            }
            for fused in [false, true] {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    device_vs_cpu_scan(&k, &mut rng, &heads, lengths, fused, Path::Chunked(acc), f64::INFINITY)
                }));
                match r {
                    Ok((eo, es)) => {
                        eprintln!("chunked {acc:?} nk {nk} nv {nv} dk {dk} dv {dv} {key_head:?} {lengths:?} fused {fused}: output {eo:.2e}, state {es:.2e}");
                        worst = (worst.0.max(eo), worst.1.max(es));
                        if eo > BOUND || es > BOUND {
                            failures.push(format!("{acc:?} {heads:?} {lengths:?} fused {fused}: output {eo:e}, state {es:e}"));
                        }
                    }
                    Err(_) => failures.push(format!("{acc:?} {heads:?} {lengths:?} fused {fused}: non-finite output")),
                }
            }
        }
        eprintln!("chunked {acc:?} worst vs CPU scan: output {:.2e}, state {:.2e}", worst.0, worst.1);
    }
    // Strong decays (g = -100 every third token) stay finite and accurate.
    let heads = DeltaRuleHeads { n_k_heads: 1, n_v_heads: 2, d_k: 64, d_v: 64, key_head: Grouped };
    let tokens = 150;
    let mut x = Operands::random(&mut rng, &heads, tokens);
    x.g.iter_mut().enumerate().for_each(|(i, g)| *g = if i % 3 == 0 { -100.0 } else { -5.0 });
    let init = rng.vec(heads.state_len(), -0.5, 0.5);
    let mut want_state = init.clone();
    let mut want = vec![0.0f32; tokens * 128];
    cpu::delta_rule_scan(&heads, x.inputs(), &pack([tokens]), &mut [&mut want_state[..]], &mut want).unwrap();
    let up = |v: &[f32]| gpu.upload(v).unwrap();
    let (dq, dk, dv, dg, db) = (up(&x.q), up(&x.k), up(&x.v), up(&x.g), up(&x.beta));
    let inputs = GpuDeltaRuleInputs { q: Rows::contiguous(&dq, 64), k: Rows::contiguous(&dk, 64), v: Rows::contiguous(&dv, 128), g: &dg, beta: &db, normalize_qk: false, fused: None };
    for acc in [ChunkAccumulate::F64, ChunkAccumulate::F32] {
        let mut st = up(&init);
        let mut out = nan(&gpu, tokens * 128);
        let segs = GpuSegments::new(&gpu, &pack([tokens]), &[0], tokens).unwrap();
        k.delta_rule_chunked(&heads, &inputs, &segs, GpuStates::Pool(&mut st), &mut out, acc).unwrap();
        let (eo, es) = (rel_err(&gpu.download(&out).unwrap(), &want), rel_err(&gpu.download(&st).unwrap(), &want_state));
        eprintln!("chunked {acc:?} strong decay: output {eo:.2e}, state {es:.2e}");
        if !(eo <= BOUND && es <= BOUND) {
            failures.push(format!("{acc:?} strong decay: output {eo:e}, state {es:e}"));
        }
    }
    // The 8-row split of the state pass computes the same bits as the default 16-row split.
    let heads = DeltaRuleHeads { n_k_heads: 2, n_v_heads: 4, d_k: 128, d_v: 128, key_head: Tiled };
    let lengths = [300usize, 64, 1];
    let tokens: usize = lengths.iter().sum();
    let x = Operands::random(&mut rng, &heads, tokens);
    let pool = rng.vec(3 * heads.state_len(), -0.5, 0.5);
    let segs = GpuSegments::new(&gpu, &pack(lengths), &[2, 0, 1], tokens).unwrap();
    let (dq, dk, dv, dg, db) = (up(&x.q), up(&x.k), up(&x.v), up(&x.g), up(&x.beta));
    let inputs = GpuDeltaRuleInputs { q: Rows::contiguous(&dq, 256), k: Rows::contiguous(&dk, 256), v: Rows::contiguous(&dv, 512), g: &dg, beta: &db, normalize_qk: false, fused: None };
    let mut k8 = GatedDeltaCuda::new(gpu.clone()).unwrap();
    k8.set_chunk_state_rows(8).unwrap();
    for acc in [ChunkAccumulate::F64, ChunkAccumulate::F32] {
        let (mut p16, mut p8) = (up(&pool), up(&pool));
        let (mut o16, mut o8) = (nan(&gpu, tokens * 512), nan(&gpu, tokens * 512));
        k.delta_rule_chunked(&heads, &inputs, &segs, GpuStates::Pool(&mut p16), &mut o16, acc).unwrap();
        k8.delta_rule_chunked(&heads, &inputs, &segs, GpuStates::Pool(&mut p8), &mut o8, acc).unwrap();
        assert_bits_eq("8-row state pass (outputs)", &gpu.download(&o8).unwrap(), &gpu.download(&o16).unwrap());
        assert_bits_eq("8-row state pass (states)", &gpu.download(&p8).unwrap(), &gpu.download(&p16).unwrap());
    }
    eprintln!("chunked: 8- and 16-row state passes agree bit for bit");
    assert!(failures.is_empty(), "chunked prefill over the bound {BOUND:e}:\n{}", failures.join("\n"));
}

/// Bound of the fast mode against the CPU scan (‖Δ‖/‖ref‖, outputs and final states): bf16
/// operands carry 2⁻⁹ relative rounding each, and a product sums many of them, so about 3e-3
/// per product is expected; this bound leaves room for the chain of products per chunk and
/// for errors carried in the state over thousands of weakly decaying tokens. The measured
/// errors are printed and recorded in BENCHMARKS.md.
const FAST_BOUND: f64 = 3e-2;

/// The fast mode (tensor cores, bf16 operands) against the CPU sequential scan: lengths around
/// the chunk size up to 4096, several sequences with scattered state slots, both key-head maps,
/// nk < nv, d_k ≠ d_v, pre-normalised and fused raw q/k, trained-like and weak decays (the
/// state then carries its error across many chunks), and strong decays.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_chunked_fast_matches_cpu_scan() {
    let gpu = gpu();
    let k = GatedDeltaCuda::new(gpu.clone()).unwrap();
    let mut rng = rng("cuda_chunked_fast_matches_cpu_scan");
    use KeyHeadMap::{Grouped, Tiled};
    let cases: &[(usize, usize, usize, usize, KeyHeadMap, &[usize])] = &[
        (2, 4, 64, 64, Grouped, &[1, 2, 63, 64, 65]),
        (2, 6, 128, 128, Tiled, &[127, 128, 300]),
        (16, 32, 128, 128, Grouped, &[1, 100, 4096]),
        (16, 32, 128, 128, Tiled, &[33, 700]),
        (2, 4, 128, 64, Tiled, &[70, 5, 0, 129]),
        (1, 3, 64, 128, Grouped, &[200]),
    ];
    let mut failures = Vec::new();
    let mut worst = [(0.0f64, 0.0f64); 2];
    for (wi, decay) in [None, Some((-0.02f32, -0.0001f32))].into_iter().enumerate() {
        for &(nk, nv, dk, dv, key_head, lengths) in cases {
            let heads = DeltaRuleHeads { n_k_heads: nk, n_v_heads: nv, d_k: dk, d_v: dv, key_head };
            if left_to_the_gpu(&gpu, &format!("{heads:?} {lengths:?}"), case_work(&heads, lengths)) {
                continue;
            }
            for fused in [false, true] {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    device_vs_cpu_scan(&k, &mut rng, &heads, lengths, fused, Path::Fast(decay), f64::INFINITY)
                }));
                match r {
                    Ok((eo, es)) => {
                        eprintln!("fast decay {decay:?} nk {nk} nv {nv} dk {dk} dv {dv} {key_head:?} {lengths:?} fused {fused}: output {eo:.2e}, state {es:.2e}");
                        worst[wi] = (worst[wi].0.max(eo), worst[wi].1.max(es));
                        if eo > FAST_BOUND || es > FAST_BOUND {
                            failures.push(format!("decay {decay:?} {heads:?} {lengths:?} fused {fused}: output {eo:e}, state {es:e}"));
                        }
                    }
                    Err(_) => failures.push(format!("decay {decay:?} {heads:?} {lengths:?} fused {fused}: non-finite output or a failed launch")),
                }
            }
        }
        eprintln!("fast decay {decay:?} worst vs CPU scan: output {:.2e}, state {:.2e}", worst[wi].0, worst[wi].1);
    }
    // Strong decays (g = -100 every third token) stay finite.
    let heads = DeltaRuleHeads { n_k_heads: 1, n_v_heads: 2, d_k: 64, d_v: 64, key_head: Grouped };
    let tokens = 150;
    let mut x = Operands::random(&mut rng, &heads, tokens);
    x.g.iter_mut().enumerate().for_each(|(i, g)| *g = if i % 3 == 0 { -100.0 } else { -5.0 });
    let init = rng.vec(heads.state_len(), -0.5, 0.5);
    let mut want_state = init.clone();
    let mut want = vec![0.0f32; tokens * 128];
    cpu::delta_rule_scan(&heads, x.inputs(), &pack([tokens]), &mut [&mut want_state[..]], &mut want).unwrap();
    let up = |v: &[f32]| gpu.upload(v).unwrap();
    let (dq, dk, dv, dg, db) = (up(&x.q), up(&x.k), up(&x.v), up(&x.g), up(&x.beta));
    let inputs = GpuDeltaRuleInputs { q: Rows::contiguous(&dq, 64), k: Rows::contiguous(&dk, 64), v: Rows::contiguous(&dv, 128), g: &dg, beta: &db, normalize_qk: false, fused: None };
    let mut st = up(&init);
    let mut out = nan(&gpu, tokens * 128);
    let segs = GpuSegments::new(&gpu, &pack([tokens]), &[0], tokens).unwrap();
    k.delta_rule_chunked_fast(&heads, &inputs, &segs, GpuStates::Pool(&mut st), &mut out).unwrap();
    let (got, got_st) = (gpu.download(&out).unwrap(), gpu.download(&st).unwrap());
    let (eo, es) = (rel_err(&got, &want), rel_err(&got_st, &want_state));
    eprintln!("fast strong decay: output {eo:.2e}, state {es:.2e}");
    if !(got.iter().all(|v| v.is_finite()) && eo <= FAST_BOUND && es <= FAST_BOUND) {
        failures.push(format!("strong decay: output {eo:e}, state {es:e}"));
    }
    // Every fast variant computes the same bits (the default one ran above), but the warpgroup
    // ones (the transposed one among them), whose products may round their partial sums
    // otherwise: within 1e-5 of the others.
    for (dk, dv) in [(128usize, 128usize), (64, 128), (128, 64)] {
        let heads = DeltaRuleHeads { n_k_heads: 2, n_v_heads: 4, d_k: dk, d_v: dv, key_head: Tiled };
        let lengths = [300usize, 64, 1];
        let tokens: usize = lengths.iter().sum();
        let x = Operands::random(&mut rng, &heads, tokens);
        let pool = rng.vec(3 * heads.state_len(), -0.5, 0.5);
        let segs = GpuSegments::new(&gpu, &pack(lengths), &[2, 0, 1], tokens).unwrap();
        let (dq, dk_, dv_, dg, db) = (up(&x.q), up(&x.k), up(&x.v), up(&x.g), up(&x.beta));
        let inputs = GpuDeltaRuleInputs { q: Rows::contiguous(&dq, 2 * dk), k: Rows::contiguous(&dk_, 2 * dk), v: Rows::contiguous(&dv_, 4 * dv), g: &dg, beta: &db, normalize_qk: false, fused: None };
        let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
        let mut kv = GatedDeltaCuda::new(gpu.clone()).unwrap();
        // Those in clusters where the device launches them (hostcuda does not: named below).
        let variants = kv.fast_variants();
        for v in variants.iter().copied() {
            kv.set_fast_variant(v).unwrap();
            let mut p = up(&pool);
            let mut o = nan(&gpu, tokens * 4 * dv);
            kv.delta_rule_chunked_fast(&heads, &inputs, &segs, GpuStates::Pool(&mut p), &mut o).unwrap();
            let got = (gpu.download(&o).unwrap(), gpu.download(&p).unwrap());
            match &first {
                None => first = Some(got),
                Some((o0, p0)) if v.warpgroup => {
                    let (eo, es) = (check("warpgroup variant (outputs)", &got.0, o0, 1e-5), check("warpgroup variant (states)", &got.1, p0, 1e-5));
                    let same = got.0.iter().chain(&got.1).zip(o0.iter().chain(p0)).all(|(a, b)| a.to_bits() == b.to_bits());
                    eprintln!("fast d_k {dk} d_v {dv}: warpgroup variant {v:?} against the others: outputs {eo:.2e}, states {es:.2e}, bit for bit: {same}");
                }
                Some((o0, p0)) => {
                    assert_bits_eq(&format!("fast variant {v:?} (outputs)"), &got.0, o0);
                    assert_bits_eq(&format!("fast variant {v:?} (states)"), &got.1, p0);
                }
            }
        }
        // The warpgroup variant runs exactly where its products exist.
        assert_eq!(variants.contains(&FAST_VARIANT), gpu.warpgroup_products(), "warpgroup variant offered exactly on sm_90");
        assert_eq!(kv.default_fast_variant(), if gpu.warpgroup_products() { FAST_VARIANT } else { FAST_VARIANT_MMA });
        let skipped: Vec<_> = FAST_VARIANTS.iter().filter(|v| !variants.contains(v)).collect();
        eprintln!("fast d_k {dk} d_v {dv}: variants {variants:?} agree; not run on this device: {skipped:?}");
        // A cluster variant, where it runs, is among those compared; elsewhere it is refused.
        let in_clusters = FastVariant { cluster: true, ..FAST_VARIANT_MMA };
        let clusters = gpu.cluster_launch().unwrap();
        assert_eq!(variants.contains(&in_clusters), clusters, "cluster variant offered exactly where clusters launch");
        if !clusters {
            assert!(matches!(kv.set_fast_variant(in_clusters), Err(Error::Input(_))));
        }
    }
    // Head sizes without a fast kernel are a clear error, not a launch.
    let heads = DeltaRuleHeads { n_k_heads: 1, n_v_heads: 1, d_k: 256, d_v: 256, key_head: Grouped };
    let b = nan(&gpu, 256);
    let one = nan(&gpu, 1);
    let mut st = nan(&gpu, 256 * 256);
    let mut out = nan(&gpu, 256);
    let x = GpuDeltaRuleInputs { q: Rows::contiguous(&b, 256), k: Rows::contiguous(&b, 256), v: Rows::contiguous(&b, 256), g: &one, beta: &one, normalize_qk: false, fused: None };
    assert!(matches!(k.delta_rule_chunked_fast(&heads, &x, &GpuSegments::new(&gpu, &pack([1]), &[0], 1).unwrap(), GpuStates::Pool(&mut st), &mut out), Err(Error::Shape(_))));
    assert!(failures.is_empty(), "fast chunked prefill over the bound {FAST_BOUND:e}:\n{}", failures.join("\n"));
}

/// The state pass in segments ([`FastVariant::segments`]). A segment whose chunks just before it
/// shrink its past below 2^-30 starts there from zeros; any other waits for the segment before
/// it. Value heads 0 and 2 decay strongly (g in [-1, -0.001]: a chunk's decay about e^-32),
/// heads 1 and 3 weakly (g in [-0.002, -0.0001]: no run of chunks fades). Four sequences on
/// scattered slots, two of them long enough for segments (24 and 18 chunks), 32 and 64 state
/// rows a block, 2, 3 and 16 segments asked, q and k normalised in the kernel (segments need
/// it), outputs poisoned. The weak heads' outputs and states equal the unsegmented pass's bit for
/// bit. The strong heads' lie within 1e-3 of it: a state 2^-30 away may round to another bf16
/// copy in a product. Every head stays within FAST_BOUND of the CPU scan. The segments' census
/// words show which blocks started early and which waited.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_chunked_fast_segments_start_early_or_wait() {
    let gpu = gpu();
    let mut rng = rng("cuda_chunked_fast_segments_start_early_or_wait");
    let mut kv = GatedDeltaCuda::new(gpu.clone()).unwrap();
    let segmented = FastVariant { segments: true, ..FAST_VARIANT_WG };
    if !gpu.warpgroup_products() {
        assert!(matches!(kv.set_fast_variant(segmented), Err(Error::Input(_))), "segments offered without warpgroup products");
        eprintln!("segments: not offered on this device (no warpgroup products), and refused");
        return;
    }
    assert!(matches!(kv.set_state_segments(Some(0)), Err(Error::Input(_))));
    let heads = DeltaRuleHeads { n_k_heads: 2, n_v_heads: 4, d_k: 128, d_v: 128, key_head: KeyHeadMap::Tiled };
    let (nv, dv, dk) = (4usize, 128usize, 128usize);
    let lengths = [1500usize, 64, 1100, 9];
    let tokens: usize = lengths.iter().sum();
    let segments = pack(lengths);
    let slots = scattered_slots(lengths.len());
    let (qk_row, v_row, sl) = (heads.n_k_heads * dk, nv * dv, heads.state_len());
    let strong = |h: usize| h % 2 == 0;
    let mut x = Operands::random(&mut rng, &heads, tokens);
    for (i, g) in x.g.iter_mut().enumerate() {
        *g = if strong(i % nv) { rng.range(-1.0, -0.001) } else { rng.range(-0.002, -0.0001) };
    }
    let (raw_q, raw_k) = (rng.vec(tokens * qk_row, -1.0, 1.0), rng.vec(tokens * qk_row, -1.0, 1.0));
    x.q = raw_q.clone();
    x.k = raw_k.clone();
    cpu::normalize_qk(&mut x.q, &mut x.k, dk).unwrap();
    let pool = rng.vec((2 * lengths.len() + 1) * sl, -0.5, 0.5);
    let (want_out, want_pool) = scan_on_cpu(&heads, &x, &segments, &slots, &pool);
    let up = |v: &[f32]| gpu.upload(v).unwrap();
    let (dq, dk_, dv_, dg, db) = (up(&raw_q), up(&raw_k), up(&x.v), up(&x.g), up(&x.beta));
    let inputs = GpuDeltaRuleInputs {
        q: Rows::contiguous(&dq, qk_row),
        k: Rows::contiguous(&dk_, qk_row),
        v: Rows::contiguous(&dv_, v_row),
        g: &dg,
        beta: &db,
        normalize_qk: true,
        fused: None,
    };
    let segs = GpuSegments::new(&gpu, &segments, &slots, tokens).unwrap();
    let run = |kv: &GatedDeltaCuda| {
        let mut p = up(&pool);
        let mut o = nan(&gpu, tokens * v_row);
        kv.delta_rule_chunked_fast(&heads, &inputs, &segs, GpuStates::Pool(&mut p), &mut o).unwrap();
        (gpu.download(&o).unwrap(), gpu.download(&p).unwrap())
    };
    // Head h's elements: every token's output columns, and its rows of every slot's state.
    let of_head = |out: &[f32], pool: &[f32], h: usize| {
        let o: Vec<f32> = (0..tokens).flat_map(|t| out[(t * nv + h) * dv..(t * nv + h + 1) * dv].to_vec()).collect();
        let p: Vec<f32> = (0..pool.len() / sl).flat_map(|s| pool[s * sl + h * dv * dk..s * sl + (h + 1) * dv * dk].to_vec()).collect();
        (o, p)
    };
    let chunks: Vec<usize> = lengths.iter().map(|l| l.div_ceil(64)).collect();
    for state_rows in [32usize, 64] {
        let base = FastVariant { state_rows, ..FAST_VARIANT_WG };
        kv.set_fast_variant(base).unwrap();
        let (o0, p0) = run(&kv);
        let (eo, es) = (check("unsegmented (outputs)", &o0, &want_out, FAST_BOUND), check("unsegmented (states)", &p0, &want_pool, FAST_BOUND));
        eprintln!("segments, {state_rows} rows: unsegmented against the CPU scan: outputs {eo:.2e}, states {es:.2e}");
        kv.set_fast_variant(FastVariant { state_rows, ..segmented }).unwrap();
        for ask in [2usize, 3, 16] {
            kv.set_state_segments(Some(ask)).unwrap();
            let (o, p) = run(&kv);
            check("segmented (outputs)", &o, &want_out, FAST_BOUND);
            check("segmented (states)", &p, &want_pool, FAST_BOUND);
            for h in 0..nv {
                let ((ho, hp), (ho0, hp0)) = (of_head(&o, &p, h), of_head(&o0, &p0, h));
                if strong(h) {
                    let (eo, es) = (check("strong head (outputs)", &ho, &ho0, 1e-3), check("strong head (states)", &hp, &hp0, 1e-3));
                    eprintln!("segments, {state_rows} rows, {ask} asked, strong head {h}: against unsegmented: outputs {eo:.2e}, states {es:.2e}");
                } else {
                    assert_bits_eq(&format!("weak head {h}, {state_rows} rows, {ask} segments (outputs)"), &ho, &ho0);
                    assert_bits_eq(&format!("weak head {h}, {state_rows} rows, {ask} segments (states)"), &hp, &hp0);
                }
            }
            // The census: segments used (the longest sequence has 24 chunks, 8 at least a
            // segment), each block's start (1: the sequence's state, 2: zeros, 3: waited).
            let n = ask.min(24 / 8);
            let slices = dv / state_rows;
            let blocks = nv * slices * lengths.len();
            let operand_words = fast_operand_regions(&heads, chunks.iter().sum()).iter().sum::<usize>() / 4;
            let ctl_at = operand_words + lengths.len() * n * sl;
            let words: Vec<u32> = {
                let scratch = kv.chunk_scratch.lock().unwrap().clone().expect("scratch allocated");
                gpu.download(&*scratch).unwrap()[ctl_at..ctl_at + 1 + blocks * n].iter().map(|v| v.to_bits()).collect()
            };
            assert_eq!(words[0] as usize, blocks * n, "tickets taken");
            for (seq, &c) in chunks.iter().enumerate() {
                let here = n.min(c / 8).max(1);
                for s in 0..n {
                    for slice in 0..slices {
                        for h in 0..nv {
                            let got = words[1 + ((seq * n + s) * slices + slice) * nv + h];
                            let want = if here == 1 || s >= here {
                                0 // one segment: no census; a segment past the sequence's: none
                            } else if s == 0 {
                                1
                            } else if strong(h) {
                                2
                            } else {
                                3
                            };
                            assert_eq!(got, want, "census: {state_rows} rows, {ask} asked, sequence {seq}, segment {s}, rows {slice}, head {h}");
                        }
                    }
                }
            }
        }
        kv.set_state_segments(None).unwrap();
    }
    // Without q and k normalised in the kernel the decay bound does not hold: one segment, the
    // unsegmented pass's bits.
    let (nq, nk_) = (up(&x.q), up(&x.k));
    let pre = GpuDeltaRuleInputs { q: Rows::contiguous(&nq, qk_row), k: Rows::contiguous(&nk_, qk_row), normalize_qk: false, ..inputs };
    let run_pre = |kv: &GatedDeltaCuda| {
        let mut p = up(&pool);
        let mut o = nan(&gpu, tokens * v_row);
        kv.delta_rule_chunked_fast(&heads, &pre, &segs, GpuStates::Pool(&mut p), &mut o).unwrap();
        (gpu.download(&o).unwrap(), gpu.download(&p).unwrap())
    };
    kv.set_state_segments(Some(3)).unwrap();
    let got = run_pre(&kv);
    kv.set_fast_variant(FAST_VARIANT_WG).unwrap();
    let want = run_pre(&kv);
    assert_bits_eq("pre-normalised q, k: segments off (outputs)", &got.0, &want.0);
    assert_bits_eq("pre-normalised q, k: segments off (states)", &got.1, &want.1);
}

/// The fast prefill with bf16 q, k, v and output against its f32 form on the same values (the
/// bf16 rows widened): the same states bit for bit, and each output the f32 form's rounded to
/// bf16 once. q, k, v are views of one `[q | k | v]` row as the model's conv writes them;
/// several sequences on scattered slots; the output poisoned with NaN first. Bad operands are
/// errors, not launches.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_chunked_fast_bf16_io_equals_f32_form() {
    use half::bf16;
    let gpu = gpu();
    let k = GatedDeltaCuda::new(gpu.clone()).unwrap();
    let mut rng = rng("cuda_chunked_fast_bf16_io_equals_f32_form");
    let cases: &[(usize, usize, usize, usize, KeyHeadMap, &[usize])] = &[
        (2, 4, 64, 64, KeyHeadMap::Grouped, &[1, 64, 65, 200]),
        (2, 6, 128, 128, KeyHeadMap::Tiled, &[300, 7]),
        (1, 3, 64, 128, KeyHeadMap::Grouped, &[129]),
        (2, 4, 128, 64, KeyHeadMap::Tiled, &[70, 0, 5]),
    ];
    for &(nk, nv, dk, dv, key_head, lengths) in cases {
        let heads = DeltaRuleHeads { n_k_heads: nk, n_v_heads: nv, d_k: dk, d_v: dv, key_head };
        let tokens: usize = lengths.iter().sum();
        let (kd, vd) = (nk * dk, nv * dv);
        let row = 2 * kd + vd;
        // bf16 values, and the same values in f32.
        let qkv16: Vec<u16> = rng.vec(tokens * row, -1.0, 1.0).iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        let qkv32: Vec<f32> = qkv16.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
        let g = rng.vec(tokens * nv, -1.0, -0.001);
        let beta = rng.vec(tokens * nv, 0.0, 1.0);
        let slots = scattered_slots(lengths.len());
        let pool = rng.vec((2 * lengths.len() + 1) * heads.state_len(), -0.5, 0.5);
        let segs = GpuSegments::new(&gpu, &pack(lengths.iter().copied()), &slots, tokens).unwrap();
        let (d16, d32, dg, db) = (gpu.upload(&qkv16).unwrap(), gpu.upload(&qkv32).unwrap(), gpu.upload(&g).unwrap(), gpu.upload(&beta).unwrap());
        for normalize_qk in [true, false] {
            let view32 = |offset| Rows { buf: &d32, offset, stride: row };
            let x32 = GpuDeltaRuleInputs { q: view32(0), k: view32(kd), v: view32(2 * kd), g: &dg, beta: &db, normalize_qk, fused: None };
            let mut p32 = gpu.upload(&pool).unwrap();
            let mut o32 = nan(&gpu, tokens * vd);
            k.delta_rule_chunked_fast(&heads, &x32, &segs, GpuStates::Pool(&mut p32), &mut o32).unwrap();
            let view16 = |offset| Rows { buf: &d16, offset, stride: row };
            let x16 = GpuBf16DeltaRuleInputs { q: view16(0), k: view16(kd), v: view16(2 * kd), g: &dg, beta: &db, normalize_qk };
            let mut p16 = gpu.upload(&pool).unwrap();
            let mut o16 = gpu.upload(&vec![0x7fc0u16; tokens * vd]).unwrap();
            k.delta_rule_chunked_fast_bf16(&heads, &x16, &segs, GpuStates::Pool(&mut p16), &mut o16).unwrap();
            let what = format!("{heads:?} {lengths:?} normalize_qk {normalize_qk}");
            assert_bits_eq(&format!("{what}: states"), &gpu.download(&p16).unwrap(), &gpu.download(&p32).unwrap());
            let rounded: Vec<u16> = gpu.download(&o32).unwrap().iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
            let got = gpu.download(&o16).unwrap();
            let differ = got.iter().zip(&rounded).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{what}: {differ} of {} bf16 outputs differ from the f32 form's rounded", got.len());
            eprintln!("fast bf16 io {what}: states and outputs as the f32 form's");
        }
    }
    // Bad operands: a misaligned view, a short buffer, a short output, head sizes without a kernel.
    let heads = DeltaRuleHeads { n_k_heads: 1, n_v_heads: 2, d_k: 64, d_v: 64, key_head: KeyHeadMap::Grouped };
    let tokens = 3;
    let segs = GpuSegments::new(&gpu, &pack([tokens]), &[0], tokens).unwrap();
    let buf = gpu.upload(&vec![0u16; tokens * 256]).unwrap();
    let (g, beta) = (gpu.upload(&vec![-0.1f32; tokens * 2]).unwrap(), gpu.upload(&vec![0.5f32; tokens * 2]).unwrap());
    let mut st = gpu.upload(&vec![0.0f32; heads.state_len()]).unwrap();
    let mut out = gpu.upload(&vec![0u16; tokens * 128]).unwrap();
    let view = |offset, stride| Rows { buf: &buf, offset, stride };
    let x = |(offset, stride): (usize, usize)| GpuBf16DeltaRuleInputs { q: view(offset, stride), k: view(64, 256), v: view(128, 256), g: &g, beta: &beta, normalize_qk: true };
    for (bad, q) in [("misaligned", (4, 256)), ("past the buffer", (0, 400)), ("overlapping rows", (0, 32))] {
        let r = k.delta_rule_chunked_fast_bf16(&heads, &x(q), &segs, GpuStates::Pool(&mut st), &mut out);
        assert!(matches!(r, Err(Error::Shape(_))), "{bad}: {:?}", r.err());
    }
    let mut short = gpu.upload(&vec![0u16; tokens * 128 - 1]).unwrap();
    assert!(matches!(k.delta_rule_chunked_fast_bf16(&heads, &x((0, 256)), &segs, GpuStates::Pool(&mut st), &mut short), Err(Error::Shape(_))));
    let big = DeltaRuleHeads { n_k_heads: 1, n_v_heads: 1, d_k: 32, d_v: 32, key_head: KeyHeadMap::Grouped };
    let mut st32 = gpu.upload(&vec![0.0f32; big.state_len()]).unwrap();
    let r = k.delta_rule_chunked_fast_bf16(&big, &x((0, 256)), &segs, GpuStates::Pool(&mut st32), &mut out);
    assert!(matches!(r, Err(Error::Shape(_))), "d 32: {:?}", r.err());
}

/// The fused recurrence (gates formed inside, output through the gated norm, each sequence's
/// state in a buffer of its own) against the three device kernels it replaces on a pool, bit
/// for bit (outputs and states), and against the CPU forms of the three within the f32
/// bound; decode steps and short scans, row counts that leave a warp's last rows empty.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_fused_recurrence_equals_gates_recurrence_norm() {
    let gpu = gpu();
    // The butterflies' form, against which the scatter sums are checked.
    let mut k = GatedDeltaCuda::new(gpu.clone()).unwrap();
    k.set_scatter_sums(ScatterSums::Off);
    let mut rng = rng("cuda_fused_recurrence_equals_gates_recurrence_norm");
    use KeyHeadMap::{Grouped, Tiled};
    let cases: &[(usize, usize, usize, usize, KeyHeadMap, &[usize])] = &[
        (16, 16, 128, 128, Grouped, &[1]),
        (16, 16, 128, 128, Tiled, &[1, 1, 1, 1, 1, 1, 1, 1]),
        (2, 4, 64, 64, Grouped, &[1, 7, 63]),
        (1, 3, 256, 20, Tiled, &[3, 1]),
        (2, 2, 32, 48, Grouped, &[5, 2, 9]),
    ];
    for &(nk, nv, dk, dv, key_head, lengths) in cases {
        let heads = DeltaRuleHeads { n_k_heads: nk, n_v_heads: nv, d_k: dk, d_v: dv, key_head };
        if left_to_the_gpu(&gpu, &format!("{heads:?} {lengths:?}"), case_work(&heads, lengths)) {
            continue;
        }
        let n = lengths.len();
        let segments = pack(lengths.iter().copied());
        let tokens: usize = lengths.iter().sum();
        let slots = scattered_slots(n);
        let (qk_row, v_row, sl) = (nk * dk, nv * dv, heads.state_len());
        let row = 2 * qk_row + v_row;
        let qkv = rng.vec(tokens * row, -1.0, 1.0);
        let (alpha, b) = (rng.vec(tokens * nv, -6.0, 6.0), rng.vec(tokens * nv, -6.0, 6.0));
        let dt = rng.vec(nv, -2.0, 2.0);
        let a: Vec<f32> = (0..nv).map(|_| -rng.range(-3.0, 1.0).exp()).collect();
        let z = rng.vec(tokens * v_row, -3.0, 3.0);
        let w = rng.vec(dv, 0.5, 1.5);
        let eps = 1e-6f32;
        let pool = rng.vec((2 * n + 1) * sl, -0.5, 0.5);

        // CPU: gates, normalised q and k, the scan, the gated norm.
        let (mut g, mut beta) = (vec![0.0; alpha.len()], vec![0.0; b.len()]);
        cpu::decay_gate(&alpha, &dt, &a, &mut g).unwrap();
        cpu::beta_gate(&b, &mut beta).unwrap();
        let split = |off: usize, width: usize| -> Vec<f32> { (0..tokens).flat_map(|t| qkv[t * row + off..][..width].iter().copied()).collect() };
        let (mut q, mut kk, v) = (split(0, qk_row), split(qk_row, qk_row), split(2 * qk_row, v_row));
        cpu::normalize_qk(&mut q, &mut kk, dk).unwrap();
        let mut cpu_states: Vec<Vec<f32>> = slots.iter().map(|&s| pool[s * sl..(s + 1) * sl].to_vec()).collect();
        let mut core = vec![f32::NAN; tokens * v_row];
        {
            let mut refs: Vec<&mut [f32]> = cpu_states.iter_mut().map(|v| &mut v[..]).collect();
            let inputs = cpu::DeltaRuleInputs { q: &q, k: &kk, v: &v, g: &g, beta: &beta };
            cpu::delta_rule_scan(&heads, inputs, &segments, &mut refs, &mut core).unwrap();
        }
        let mut want = vec![f32::NAN; core.len()];
        cpu::gated_rms_norm(&core, &z, &w, eps, &mut want).unwrap();

        // Device, three kernels on a pool.
        let segs = GpuSegments::new(&gpu, &segments, &slots, tokens).unwrap();
        let (dqkv, dalpha, db, ddt, da, dz, dw) = (
            gpu.upload(&qkv).unwrap(),
            gpu.upload(&alpha).unwrap(),
            gpu.upload(&b).unwrap(),
            gpu.upload(&dt).unwrap(),
            gpu.upload(&a).unwrap(),
            gpu.upload(&z).unwrap(),
            gpu.upload(&w).unwrap(),
        );
        let rows = |off| Rows { buf: &dqkv, offset: off, stride: row };
        let (mut dg, mut dbeta) = (nan(&gpu, alpha.len()), nan(&gpu, b.len()));
        k.gates(&dalpha, &db, &ddt, &da, &mut dg, &mut dbeta).unwrap();
        let plain = GpuDeltaRuleInputs { q: rows(0), k: rows(qk_row), v: rows(2 * qk_row), g: &dg, beta: &dbeta, normalize_qk: true, fused: None };
        let mut dpool = gpu.upload(&pool).unwrap();
        let mut dcore = nan(&gpu, tokens * v_row);
        k.delta_rule(&heads, &plain, &segs, GpuStates::Pool(&mut dpool), &mut dcore).unwrap();
        let mut three = nan(&gpu, tokens * v_row);
        k.gated_rms_norm(&dcore, &dz, &dw, eps, &mut three).unwrap();
        let (three, three_pool) = (gpu.download(&three).unwrap(), gpu.download(&dpool).unwrap());

        // Device, fused, each sequence's state in its own buffer.
        let fused = FusedGatesNorm { dt_bias: &ddt, a: &da, z: Rows::contiguous(&dz, v_row), norm: &dw, eps };
        let x = GpuDeltaRuleInputs { g: &dalpha, beta: &db, fused: Some(fused), ..plain };
        let mut own: Vec<CudaSlice<f32>> = slots.iter().map(|&s| gpu.upload(&pool[s * sl..(s + 1) * sl]).unwrap()).collect();
        let mut out = nan(&gpu, tokens * v_row);
        {
            let mut refs: Vec<&mut CudaSlice<f32>> = own.iter_mut().collect();
            k.delta_rule(&heads, &x, &segs, GpuStates::Each(&mut refs), &mut out).unwrap();
        }
        let got = gpu.download(&out).unwrap();
        assert_bits_eq("fused recurrence vs three kernels (outputs)", &got, &three);
        // The fused form with either sums, bounded to two blocks a multiprocessor or not (d_k <=
        // 128; above it the bound is ignored): the same bits.
        // Last, the default requesting its first state rows before it awaits the kernel before
        // it (EARLY_STATE, what a decode step's dependent launch takes).
        for (scatter, bound64, early) in [(ScatterSums::On, false, false), (ScatterSums::Off, false, false), (ScatterSums::Off, true, false), (ScatterSums::On, true, false), (ScatterSums::On, true, true)] {
            let mut ks = GatedDeltaCuda::new(gpu.clone()).unwrap();
            ks.set_scatter_sums(scatter);
            ks.set_fused_bound64(bound64);
            ks.set_early_state(early);
            let mut p = gpu.upload(&pool).unwrap();
            let mut o = nan(&gpu, tokens * v_row);
            ks.delta_rule(&heads, &x, &segs, GpuStates::Pool(&mut p), &mut o).unwrap();
            let form = format!("fused recurrence, sums {scatter:?}, bounded to 64 registers {bound64}, early state {early}, vs three kernels");
            assert_bits_eq(&format!("{form} (outputs)"), &gpu.download(&o).unwrap(), &three);
            assert_bits_eq(&format!("{form} (states)"), &gpu.download(&p).unwrap(), &three_pool);
        }
        let mut es = 0.0f64;
        for (i, &s) in slots.iter().enumerate() {
            let st = gpu.download(&own[i]).unwrap();
            assert_bits_eq("fused recurrence vs three kernels (states)", &st, &three_pool[s * sl..(s + 1) * sl]);
            es = es.max(check("fused recurrence state vs CPU", &st, &cpu_states[i], BOUND));
        }
        let eo = check("fused recurrence vs CPU", &got, &want, BOUND);
        eprintln!("fused recurrence nk {nk} nv {nv} dk {dk} dv {dv} {key_head:?} {lengths:?}: == three kernels; vs CPU output {eo:.2e}, state {es:.2e}");
    }
    // Shapes it cannot take are clear errors: value heads over FUSED_MAX_DV rows, fused inputs
    // on the chunked form, a wrong norm weight, states of the wrong size.
    let segs = GpuSegments::new(&gpu, &pack([1]), &[0], 1).unwrap();
    let big = nan(&gpu, 4096);
    let one = nan(&gpu, 1);
    let (wrong, n256) = (nan(&gpu, 7), nan(&gpu, 256));
    let heads = DeltaRuleHeads { n_k_heads: 1, n_v_heads: 1, d_k: 32, d_v: 256, key_head: Grouped };
    let fused = FusedGatesNorm { dt_bias: &one, a: &one, z: Rows::contiguous(&big, 256), norm: &n256, eps: 1e-6 };
    let x = GpuDeltaRuleInputs { q: Rows::contiguous(&big, 32), k: Rows::contiguous(&big, 32), v: Rows::contiguous(&big, 256), g: &one, beta: &one, normalize_qk: true, fused: Some(fused) };
    let (mut st, mut out) = (nan(&gpu, 32 * 256), nan(&gpu, 256));
    assert!(matches!(k.delta_rule(&heads, &x, &segs, GpuStates::Pool(&mut st), &mut out), Err(Error::Shape(_))));
    assert!(matches!(k.delta_rule_chunked(&heads, &x, &segs, GpuStates::Pool(&mut st), &mut out, ChunkAccumulate::F32), Err(Error::Shape(_))));
    let heads = DeltaRuleHeads { d_v: 64, ..heads };
    let fused = FusedGatesNorm { norm: &wrong, z: Rows::contiguous(&big, 64), ..fused };
    let x = GpuDeltaRuleInputs { v: Rows::contiguous(&big, 64), fused: Some(fused), ..x };
    let (mut st, mut out) = (nan(&gpu, 32 * 64), nan(&gpu, 64));
    assert!(matches!(k.delta_rule(&heads, &x, &segs, GpuStates::Pool(&mut st), &mut out), Err(Error::Shape(_))));
    let mut small = nan(&gpu, 32 * 63);
    let mut refs = vec![&mut small];
    let x = GpuDeltaRuleInputs { fused: None, ..x };
    assert!(matches!(k.delta_rule(&heads, &x, &segs, GpuStates::Each(&mut refs), &mut out), Err(Error::Shape(_))));
}

/// The warpgroup products (src/kernels/wgmma.cuh, checked through wgmma_check.cu) against the
/// CPU in f64: d = c + a b^T over k of 16, 64 and 128, with the operands' core matrices stored
/// k-step after k-step (`lbo` 128, `sbo` past a row group's whole k, padded) or row group after
/// row group (`sbo` 128, `lbo` past a k-step's rows, padded), so that a misread stride of the
/// descriptor lands on other values; with a prior accumulator and without (the first k-step
/// then replaces accumulators that start as NaN); with a stored K-major and M-major (the
/// transposed-A form). Products of bf16 are exact in f32, so only the order of the sums differs
/// from the CPU's. They exist only on sm_90 (H100, H200).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-test.sh"]
fn cuda_wgmma_products_match_cpu() {
    use half::bf16;
    let gpu = gpu();
    assert!(gpu.warpgroup_products(), "warpgroup products need an sm_90 GPU (H100, H200); this one compiles for {}", gpu.arch());
    let f = gpu.function(&WGMMA_CHECK, "tern_gdn_wgmma_check_m64n32").unwrap();
    let mut rng = rng("cuda_wgmma_products_match_cpu");
    let bf16_rows = |rng: &mut Lcg, n: usize| -> (Vec<u16>, Vec<f32>) {
        let bits: Vec<u16> = rng.vec(n, -1.0, 1.0).iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        let values = bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
        (bits, values)
    };
    for k in [16usize, 64, 128] {
        let forms = [(false, true, false), (true, false, false), (false, false, false), (true, true, false), (false, true, true), (true, false, true)];
        for (rows_adjacent, prior, a_m_major) in forms {
            // (lbo, sbo) of a tile of `rows` rows; 16 bytes of padding between the runs.
            let strides = |rows: usize| -> (u32, u32) {
                if rows_adjacent {
                    ((128 * rows / 8 + 16) as u32, 128)
                } else {
                    (128, (128 * k / 8 + 16) as u32)
                }
            };
            let ((lbo_a, sbo_a), (lbo_b, sbo_b)) = (strides(64), strides(32));
            // The last byte of a tile: its last core matrix's end.
            let span = |rows: usize, lbo: u32, sbo: u32| (rows / 8 - 1) as u32 * sbo + (k / 8 - 1) as u32 * lbo + 128;
            let b_at = span(64, lbo_a, sbo_a).next_multiple_of(16);
            let shared = b_at + span(32, lbo_b, sbo_b);
            let (a16, a) = bf16_rows(&mut rng, 64 * k);
            let (b16, b) = bf16_rows(&mut rng, 32 * k);
            let c = rng.vec(64 * 32, -1.0, 1.0);
            let want: Vec<f32> = (0..64 * 32)
                .map(|i| {
                    let (r, n) = (i / 32, i % 32);
                    let dot: f64 = (0..k).map(|j| a[r * k + j] as f64 * b[n * k + j] as f64).sum();
                    (dot + if prior { c[i] as f64 } else { 0.0 }) as f32
                })
                .collect();
            let (da, db, dc) = (gpu.upload(&a16).unwrap(), gpu.upload(&b16).unwrap(), gpu.upload(&c).unwrap());
            let d = nan(&gpu, 64 * 32);
            let c_at = gpu.ptr_opt(prior.then_some(&dc));
            let (ki, a_mn) = (k as i32, a_m_major as i32);
            let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: shared };
            let mut l = gpu.launch_builder(&f);
            l.buf(&da).buf(&db).arg(&c_at).buf(&d).arg(&ki).arg(&lbo_a).arg(&sbo_a).arg(&lbo_b).arg(&sbo_b).arg(&b_at).arg(&a_mn);
            // SAFETY: argument types match tern_gdn_wgmma_check_m64n32; a is 64 x k, b 32 x k, c
            // and d 64 x 32, and the shared memory holds both tiles at these strides.
            unsafe { l.launch(cfg) }.unwrap();
            let e = check("wgmma", &gpu.download(&d).unwrap(), &want, 1e-6);
            let order = if rows_adjacent { "row group after row group" } else { "k-step after k-step" };
            eprintln!("wgmma k {k}, core matrices {order}, prior {prior}, a M-major {a_m_major}: {e:.2e}");
        }
    }
}
