//! Rate of the CUDA attention kernels, f32 (CUDA cores) against bf16 (tensor cores, fast mode),
//! on the encoder's two attention shapes: EmbeddingGemma 2 sliding layers (64 sequences × 512
//! tokens, hd 256, 4 q / 2 kv heads, window 512) and global layers (1 × 8192, hd 512, 4 q / 1 kv,
//! no window). FLOPs = 4·q_heads·hd·(visible keys summed over queries): the two products only.
//! Usage: cargo run --release --example attention_bench [reps]

use std::time::Instant;

use tern::cuda::Gpu;
use tern::kernels::attention::cuda::{AttentionCuda, GpuAttentionBatch};
use tern::kernels::attention::AttentionShape;
use tern::kernels::backend::View;
use tern::kernels::norm::cuda::NormOut;
use tern::kernels::pack;

/// (name, sequences, tokens each, q heads, kv heads, hd, window)
type Case = (&'static str, usize, usize, usize, usize, usize, Option<usize>);

fn main() -> tern::Result<()> {
    let reps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(20);
    let gpu = Gpu::new(0)?;
    let k = AttentionCuda::new(gpu.clone())?;
    println!("{} ({}), {reps} reps after one warm-up", gpu.name(), gpu.arch());
    let cases: [Case; 2] =
        [("64 x 512, hd 256, 4q/2kv, window 512", 64, 512, 4, 2, 256, Some(512)), ("1 x 8192, hd 512, 4q/1kv, full", 1, 8192, 4, 1, 512, None)];
    for (name, seqs, len, q_heads, kv_heads, hd, window) in cases {
        let segs = pack(std::iter::repeat_n(len, seqs));
        let rows = seqs * len;
        let (qw, kw) = (q_heads * hd, kv_heads * hd);
        let ld = qw + 2 * kw;
        let mut state = 0x9e3779b97f4a7c15u64;
        let qkv: Vec<f32> = (0..rows * ld)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 3.0 - 1.5
            })
            .collect();
        let dqkv = gpu.upload(&qkv)?;
        let batch = GpuAttentionBatch::new(&gpu, &segs)?;
        let shape = AttentionShape { q_heads, kv_heads, hd, scale: 1.0 / (hd as f32).sqrt(), max_distance: window };
        let visible: usize = (0..len).map(|i| window.map_or(len, |w| (i + w + 1).min(len) - i.saturating_sub(w))).sum::<usize>() * seqs;
        let flops = 4.0 * (q_heads * hd * visible) as f64;
        let mut out = gpu.alloc::<f32>(rows * qw)?;
        let mut rates = Vec::new();
        for bf16 in [false, true] {
            let run = |out: &mut tern::cuda::CudaSlice<f32>| {
                let (qv, kv, vv) = (View::new(&dqkv, 0, ld), View::new(&dqkv, qw, ld), View::new(&dqkv, qw + kw, ld));
                let o = NormOut { f32: Some(out), bf16: None };
                if bf16 {
                    k.attention_bf16(qv, kv, vv, &batch, &shape, o)
                } else {
                    k.attention(qv, kv, vv, &batch, &shape, o)
                }
            };
            run(&mut out)?;
            gpu.synchronize()?;
            let t = Instant::now();
            for _ in 0..reps {
                run(&mut out)?;
            }
            gpu.synchronize()?;
            let s = t.elapsed().as_secs_f64() / reps as f64;
            rates.push(flops / s / 1e12);
            println!("{name}: {:>4} {:8.3} ms  {:7.1} TFLOP/s", if bf16 { "bf16" } else { "f32" }, s * 1e3, flops / s / 1e12);
        }
        println!("{name}: bf16 / f32 = {:.1}x", rates[1] / rates[0]);
    }
    Ok(())
}
