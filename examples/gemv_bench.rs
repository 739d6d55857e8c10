//! Times the few-row products of a Qwen3.5-0.8B decode step and of an EmbeddingGemma 300M
//! query (`Blas::linear` and `glu` on the GEMV kernels) on the layers' real shapes and stored
//! types, each launch replayed inside a recorded graph (as a decode step runs it), against the
//! copy bandwidth measured in the same run:
//!
//!   cargo run --release --example gemv_bench [ROWS...]   (on a machine with an NVIDIA GPU)
//!
//! TERN_GEMV_SPLIT=0 turns off the split of few-feature rows over several warps, to measure
//! both forms on one machine.

use std::sync::Arc;

use tern::cuda::Gpu;
use tern::kernels::cuda_ops::{CudaOps, Precision};
use tern::kernels::matmul::cuda::{Blas, GemvOutput};
use tern::kernels::matmul::{quantize_q8_0, Weights};
use tern::Result;

mod timing;
use timing::{err, record_graph};

/// Microseconds per call of `f`, from a graph of `per_graph` calls replayed `reps` times (one
/// untimed run of `f` and one untimed replay first).
fn time_in_graph(gpu: &Arc<Gpu>, per_graph: usize, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let graph = record_graph(gpu, || (0..per_graph).try_for_each(|_| f()))?;
    graph.launch().map_err(err)?;
    gpu.synchronize()?;
    let stream = gpu.stream();
    let (start, end) = (gpu.event()?, gpu.event()?);
    start.record(stream).map_err(err)?;
    for _ in 0..reps {
        graph.launch().map_err(err)?;
    }
    end.record(stream).map_err(err)?;
    let ms = start.elapsed_ms(&end).map_err(err)? as f64;
    Ok(ms * 1e3 / (per_graph * reps) as f64)
}

fn main() -> Result<()> {
    let rows: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("rows")).collect();
    let rows = if rows.is_empty() { vec![1, 8] } else { rows };
    let gpu = Gpu::new(0)?;
    let copy_bw = CudaOps::new(gpu.clone(), Precision::F32)?.measure_copy_bandwidth(1 << 30)?;
    let blas = Blas::new(gpu.clone(), false)?;
    println!(
        "# copy bandwidth {:.0} GB/s; split {}",
        copy_bw / 1e9,
        if std::env::var("TERN_GEMV_SPLIT").is_ok_and(|v| v == "0") { "off" } else { "on" }
    );
    println!("{:<28} {:>5} {:>5} {:>10} {:>9} {:>8}", "product (out x in)", "type", "rows", "us/launch", "GB/s", "of copy");
    // (name, out, in, gated): Qwen3.5-0.8B's decode products.
    let shapes = [
        ("gdn out 1024x2048", 1024usize, 2048usize, false),
        ("ffn down 1024x3584", 1024, 3584, false),
        ("ffn gate|up 7168x1024", 7168, 1024, true),
        ("attn qgkv 5120x1024", 5120, 1024, false),
        ("gdn in 8224x1024", 8224, 1024, false),
        ("head 248320x1024", 248_320, 1024, false),
        // EmbeddingGemma 300M's layer (a short query is a few rows of x; f32 and bf16 weights).
        ("eg qkv 1280x768", 1280, 768, false),
        ("eg o 768x768", 768, 768, false),
        ("eg gate|up 2304x768", 2304, 768, true),
        ("eg down 768x1152", 768, 1152, false),
    ];
    let mut seed = 0x9e3779b97f4a7c15u64;
    for &(name, out, inp, gated) in &shapes {
        let w: Vec<f32> = (0..out * inp)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
            })
            .collect();
        let w16: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let q8 = quantize_q8_0(&w);
        let stored = if name.starts_with("eg ") {
            [("f32", Weights::F32(&w), 4 * w.len()), ("bf16", Weights::Bf16(&w16), 2 * w.len())]
        } else {
            [("bf16", Weights::Bf16(&w16), 2 * w.len()), ("q8_0", Weights::Q8_0(&q8), q8.len())]
        };
        for (kind, weights, bytes) in stored {
            let m = blas.matrix(&weights, out, inp)?;
            for &r in &rows {
                let x = gpu.upload(&vec![0.5f32; r * inp])?;
                let mut y = gpu.alloc::<f32>(r * if gated { out / 2 } else { out })?;
                let per = if out > 100_000 { 4 } else { 50 };
                let us = time_in_graph(&gpu, per, 10, || {
                    if gated {
                        blas.glu(&x, r, &m, GemvOutput::Silu, &mut y, |_, _| Err(tern::Error::Shape("not a GEMV".into())))
                    } else {
                        blas.linear(&x, r, &m, &mut y)
                    }
                })?;
                let gbs = bytes as f64 / (us * 1e-6) / 1e9;
                println!("{name:<28} {kind:>5} {r:>5} {us:>10.2} {gbs:>9.0} {:>8.2}", gbs * 1e9 / copy_bw);
            }
        }
    }
    Ok(())
}
