//! How close a chain of one-row products can come to the copy rate when the chain is one
//! persistent launch (examples/gemv_chain.cu) instead of a graph of launches: the question that
//! decides whether a decode step of Qwen3.5-0.8B (~130 launches, ~0.4 of its weight roofline)
//! can reach 80% of it without one kernel for the whole step.
//!
//!   cargo run --release --example gemv_chain_bench [layers=N] [forms=WxP,...|none] [grid=N] [reps=N]   (on a machine with an NVIDIA GPU)
//!
//! `grid=N` launches N blocks plainly instead of as many as fit cooperatively (N = 1 needs no
//! grid barrier to be met). `reps=0` checks the chain against the CPU and times nothing:
//! scripts/test-hostcuda.sh runs it so on hostcuda (tools/hostcuda), whose cooperative launches
//! run every block's threads together.
//!
//! The chain is the products of N (default 24) gated-delta layers of Qwen3.5-0.8B in bf16:
//! input projections 8224 x 1024, output 1024 x 2048, gate|up 7168 x 1024, down 1024 x 3584,
//! each layer's own weights (1.03 GB for 24 layers, far past the L2). Timed, against the copy
//! rate of the same run:
//! - `graph`: tern's GEMV kernels (Blas::linear), one launch a product, replayed from a graph
//!   (as a decode step runs them);
//! - `persistent WxP`: one cooperative launch of blocks of W streaming warps (and a control
//!   warp), each stage's input the previous stage's output (a grid barrier between), each
//!   warp's weights streamed ahead into P pieces of 16 bytes a lane of shared memory.
//!
//! Measured on an H100 (BENCHMARKS.md, eighteenth session): every persistent form 0.36-0.41 of
//! copy against the graph's 0.62, a stage's barrier and input staging alone 2.6-3.6 µs, more
//! than a launch costs inside the graph.
//!
//! The persistent chain's outputs are checked first against the products formed on the CPU in
//! f64 from the same inputs (each stage from the GPU's output of the stage before), relative
//! error ≤ 1e-5 for every stage, or the program fails.

use std::sync::Arc;

use cudarc::driver::sys;
use tern::cuda::{CudaSlice, Gpu, KernelSource};
use tern::kernels::cuda_ops::{CudaOps, Precision};
use tern::kernels::matmul::cuda::{Blas, GemvOutput};
use tern::kernels::matmul::Weights;
use tern::Result;

const CHAIN: KernelSource = KernelSource { name: "tern_gemv_chain_experiment", code: include_str!("gemv_chain.cu") };

mod timing;
use timing::{err, time_graph_ms, time_ms};

struct Lcg(u64);
impl Lcg {
    /// Uniform in [-a, a).
    fn next(&mut self, a: f32) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (((self.0 >> 40) as u32) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * a
    }
}

fn bf16_to_f64(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

struct Stage {
    n: usize,
    k: usize,
    host: Vec<u16>,
    w: CudaSlice<u16>,
    y: CudaSlice<f32>,
}

/// One launch of the chain over `table` (clearing the arrival counter first): `grid` blocks,
/// cooperative when its flag is set (as many blocks as fit at once), else plain (one block).
#[allow(clippy::too_many_arguments)]
fn launch_chain(gpu: &Gpu, f: &cudarc::driver::CudaFunction, table: &CudaSlice<u64>, n_stages: i32, arrivals: &CudaSlice<u32>, ring: i32, x_max: i32, grid: (u32, bool), threads: u32, smem: u32) -> Result<()> {
    let (grid, cooperative) = grid;
    let (mut tp, mut ap) = (gpu.ptr(table), gpu.ptr(arrivals));
    let (mut ns, mut rg, mut xm) = (n_stages, ring, x_max);
    let mut params: [*mut std::ffi::c_void; 5] = [
        &mut tp as *mut u64 as *mut _,
        &mut ns as *mut i32 as *mut _,
        &mut ap as *mut u64 as *mut _,
        &mut rg as *mut i32 as *mut _,
        &mut xm as *mut i32 as *mut _,
    ];
    gpu.context().bind_to_thread().map_err(err)?;
    // SAFETY: the parameters match tern_gemv_chain's (a device pointer, int, device pointer,
    // int, int); the table's stages point at buffers that outlive the launch; a zeroed
    // attribute is valid and its id and value are set together.
    unsafe {
        sys::cuMemsetD32Async(ap, 0, 1, gpu.stream().cu_stream()).result().map_err(err)?;
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr.value.cooperative = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: gpu.stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: cooperative as std::ffi::c_uint,
        };
        sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()).result().map_err(err)?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let arg = |name: &str| std::env::args().find_map(|a| a.strip_prefix(&format!("{name}=")).map(str::to_string));
    let layers: usize = arg("layers").map_or(24, |v| v.parse().expect("layers=N"));
    let reps: usize = arg("reps").map_or(20, |v| v.parse().expect("reps=N"));
    let plain_grid: Option<u32> = arg("grid").map(|v| v.parse().expect("grid=N"));
    // (streaming warps a block, ring pieces a lane): 8 or 16 warps; rings of 14 pieces or more
    // (a 3584-wide row is 14 pieces a lane).
    let forms: Vec<(usize, usize)> = arg("forms").map_or(vec![(8, 16), (8, 24), (8, 48), (16, 14), (16, 24)], |v| {
        v.split(',')
            .filter(|f| !f.is_empty() && *f != "none")
            .map(|f| f.split_once('x').and_then(|(w, r)| Some((w.parse().ok()?, r.parse().ok()?))).expect("forms=WxP,..."))
            .collect()
    });
    let gpu: Arc<Gpu> = Gpu::new(0)?;
    let sms = gpu.multiprocessors()?;
    // Nothing is timed with reps=0, so nothing needs the copy rate.
    let copy_bw = if reps == 0 { f64::NAN } else { CudaOps::new(gpu.clone(), Precision::F32)?.measure_copy_bandwidth(1 << 30)? };
    let blas = Blas::new(gpu.clone(), false)?;
    println!("# {} ({} SMs), copy bandwidth {:.0} GB/s, {layers} layers", gpu.name(), sms, copy_bw / 1e9);

    // (out, in) of a gated-delta layer's products; each stage reads the first `in` outputs of
    // the stage before (every `in` is at most the previous `out`).
    let shapes = [(8224usize, 1024usize), (1024, 2048), (7168, 1024), (1024, 3584)];
    let mut rng = Lcg(0x2545f4914f6cdd1d);
    let mut stages = Vec::new();
    for _ in 0..layers {
        for &(n, k) in &shapes {
            // Weights of ±sqrt(3 / k): each output keeps about the scale of its input.
            let a = (3.0 / k as f32).sqrt();
            let host: Vec<u16> = (0..n * k).map(|_| half::bf16::from_f32(rng.next(a)).to_bits()).collect();
            let w = gpu.upload(&host)?;
            let y = gpu.zeros::<f32>(n)?;
            stages.push(Stage { n, k, host, w, y });
        }
    }
    let x0_host: Vec<f32> = (0..shapes[0].1).map(|_| rng.next(1.0)).collect();
    let x0 = gpu.upload(&x0_host)?;
    let bytes: usize = stages.iter().map(|s| 2 * s.n * s.k).sum();
    let x_max = stages.iter().map(|s| s.k).max().unwrap_or(0);

    // The stage table, tern_chain_stage's layout: w, x, y (u64), then n, k (i32) in one u64.
    let mut table = Vec::with_capacity(4 * stages.len());
    for (i, s) in stages.iter().enumerate() {
        let x = if i == 0 { gpu.ptr(&x0) } else { gpu.ptr(&stages[i - 1].y) };
        table.extend_from_slice(&[gpu.ptr(&s.w), x, gpu.ptr(&s.y), (s.n as u64) | ((s.k as u64) << 32)]);
    }
    // The same stages with no rows (n = 0): the chain's barriers and staging alone.
    let empty: Vec<u64> = table.chunks(4).flat_map(|e| [e[0], e[1], e[2], e[3] & !0xffff_ffff]).collect();
    let table = gpu.upload(&table)?;
    let empty_table = gpu.upload(&empty)?;
    let arrivals = gpu.zeros::<u32>(1)?;
    let report = |name: &str, ms: f64| {
        let bw = bytes as f64 / (ms * 1e-3);
        println!("{name:<22} {:>9.1} us {:>7.0} GB/s {:>6.3} of copy", ms * 1e3, bw / 1e9, bw / copy_bw);
        println!("RESULT chain form={} layers={layers} us={:.2} gbps={:.1} copy_fraction={:.4}", name.replace(' ', "_"), ms * 1e3, bw / 1e9, bw / copy_bw);
    };
    println!("{} products, {:.1} MB of weights", stages.len(), bytes as f64 / 1e6);

    for &(warps, ring) in &forms {
        let name = format!("persistent {warps}x{ring}");
        let Ok(f) = gpu.function(&CHAIN, &format!("tern_gemv_chain_w{warps}")) else {
            println!("{name}: no kernel for {warps} warps (8 or 16); skipped");
            continue;
        };
        let threads = (warps + 1) * 32;
        let smem = x_max * 4 + warps * 32 * 16 * ring;
        if ring * 256 < x_max {
            println!("{name}: a {x_max}-wide row does not fit; skipped");
            continue;
        }
        use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN_SMEM;
        f.set_attribute(MAX_DYN_SMEM, smem as i32).map_err(err)?;
        let per_sm = f.occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None).map_err(err)? as usize;
        if per_sm == 0 {
            println!("{name}: {smem} bytes of shared memory leave no block resident; skipped");
            continue;
        }
        let grid = plain_grid.map_or(((sms * per_sm) as u32, true), |g| (g, false));
        let n_stages = stages.len() as i32;
        let run_over = |t: &CudaSlice<u64>| launch_chain(&gpu, &f, t, n_stages, &arrivals, ring as i32, x_max as i32, grid, threads as u32, smem as u32);
        let run = || run_over(&table);
        // Check: poison the outputs, run once, compare every stage with the CPU's products.
        for s in stages.iter_mut() {
            gpu.poison(&mut s.y)?;
        }
        run()?;
        gpu.synchronize()?;
        let mut prev = x0_host.clone();
        let mut worst = 0.0f64;
        for (i, s) in stages.iter().enumerate() {
            let got = gpu.download(&s.y)?;
            let (mut d, mut r) = (0.0f64, 0.0f64);
            for row in 0..s.n {
                let w = &s.host[row * s.k..(row + 1) * s.k];
                let want: f64 = w.iter().zip(&prev).map(|(&b, &x)| bf16_to_f64(b) * x as f64).sum();
                d += (got[row] as f64 - want).powi(2);
                r += want * want;
            }
            let rel = (d / r).sqrt();
            if !(rel <= 1e-5) {
                return Err(tern::Error::Cuda(format!("{name}: stage {i} differs from the CPU by {rel:.3e} (bound 1e-5)")));
            }
            worst = worst.max(rel);
            prev = got;
        }
        println!("{name}: {} blocks ({per_sm} a multiprocessor), {smem} bytes of shared memory; every stage within {worst:.2e} of the CPU", grid.0);
        if reps == 0 {
            continue;
        }
        let ms = match time_graph_ms(&gpu, reps, run) {
            Ok(ms) => ms,
            Err(e) => {
                println!("{name}: graph capture failed ({e:?}); timing stream launches");
                time_ms(&gpu, 2, reps, |_| run())?
            }
        };
        report(&name, ms);
        // The same launch over stages of no rows: only the grid barriers and the inputs' staging
        // remain, so this is what the chain's synchronisation costs (µs a stage, printed).
        let ms_sync = time_graph_ms(&gpu, reps, || run_over(&empty_table))?;
        println!("{name}: barriers alone {:.2} us a stage", ms_sync * 1e3 / n_stages as f64);
        println!("RESULT chain_sync form={} us_per_stage={:.3}", name.replace(' ', "_"), ms_sync * 1e3 / n_stages as f64);
    }

    if reps == 0 {
        return Ok(());
    }
    // tern's GEMVs, one launch a product, from a graph; inputs of the right length (the
    // stream orders each launch after the one before, as in a decode step).
    let mats = stages
        .iter()
        .map(|s| blas.matrix(&Weights::Bf16(&s.host), s.n, s.k))
        .collect::<Result<Vec<_>>>()?;
    let xs = stages.iter().map(|s| gpu.upload(&vec![0.5f32; s.k])).collect::<Result<Vec<_>>>()?;
    let mut ys = stages.iter().map(|s| gpu.zeros::<f32>(s.n)).collect::<Result<Vec<_>>>()?;
    let ms = time_graph_ms(&gpu, reps, || {
        for ((m, x), y) in mats.iter().zip(&xs).zip(ys.iter_mut()) {
            blas.linear(x, 1, m, y)?;
        }
        Ok(())
    })?;
    report("graph of launches", ms);
    // The same with each 1024-feature product (a layer's output projection and FFN down
    // projection) ending in the residual step and the next norm, as a decode step runs them
    // (Blas::linear_residual_norm: the last block to finish forms the norm): what that tail
    // costs on the step's critical path.
    let norm_w = gpu.upload(&vec![1.0f32; 1024])?;
    let mut normed = gpu.zeros::<f32>(1024)?;
    let ms = time_graph_ms(&gpu, reps, || {
        for ((m, x), y) in mats.iter().zip(&xs).zip(ys.iter_mut()) {
            if m.out == 1024 && blas.linear_residual_norm(x, 1, m, y, &norm_w, 1e-6, &mut normed)? {
                continue;
            }
            blas.linear(x, 1, m, y)?;
        }
        Ok(())
    })?;
    report("graph, norm tails", ms);
    // The same with the gate|up products gated (Blas::glu: act(gate)·up written, 3584
    // features), as a decode step runs them: the row to compare the next one with.
    let mut gated = gpu.zeros::<f32>(7168 / 2)?;
    let ms = time_graph_ms(&gpu, reps, || {
        for ((m, x), y) in mats.iter().zip(&xs).zip(ys.iter_mut()) {
            if m.out == 1024 && blas.linear_residual_norm(x, 1, m, y, &norm_w, 1e-6, &mut normed)? {
                continue;
            }
            if m.out == 7168 {
                blas.glu(x, 1, m, GemvOutput::Silu, &mut gated, |_, _| unreachable!("one row takes the GEMV"))?;
                continue;
            }
            blas.linear(x, 1, m, y)?;
        }
        Ok(())
    })?;
    report("graph, norm tails, gated", ms);
    // The same with each layer's first norm formed in the blocks of the gated product after it
    // (Blas::linear_residual_norm_then, as a dense FFN's decode step runs it; not with
    // TERN_GEMV_NORMED=0): the output projection has no tail; the gate|up product (its 7168 rows
    // as a gate over an up) forms rms(stream)·w itself.
    if std::env::var("TERN_GEMV_NORMED").as_deref() == Ok("0") {
        println!("(norms in the gated products: not timed, TERN_GEMV_NORMED=0 declines them)");
        return Ok(());
    }
    let ms = time_graph_ms(&gpu, reps, || {
        let mut i = 0;
        while i < mats.len() {
            let (m, x) = (&mats[i], &xs[i]);
            if m.out == 1024 && i + 1 < mats.len() && mats[i + 1].out == 7168 {
                if blas.linear_residual_norm_then(x, m, &mut ys[i], &norm_w, 1e-6, &mut normed, &mats[i + 1], GemvOutput::Silu, &mut gated)? {
                    i += 2;
                    continue;
                }
            }
            if m.out == 1024 && blas.linear_residual_norm(x, 1, m, &mut ys[i], &norm_w, 1e-6, &mut normed)? {
                i += 1;
                continue;
            }
            blas.linear(x, 1, m, &mut ys[i])?;
            i += 1;
        }
        Ok(())
    })?;
    report("graph, norms in the gated products", ms);
    Ok(())
}
