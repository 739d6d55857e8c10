//! Measures the f32 matrix-product rate of the CPU kernel on projection shapes, the compute
//! roofline that the embedding benchmark is read against.
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    for (m, n, k) in [(4096, 1152, 768), (4096, 768, 1152), (4096, 768, 768), (4096, 256, 768), (16, 1152, 768)] {
        let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01).collect();
        let mut y = vec![0.0f32; m * n];
        let run = |y: &mut [f32]| tern::kernels::matmul::linear_into(&x, m, &w, n, k, y).unwrap();
        pool.install(|| run(&mut y));
        let reps = (2e10 / (2.0 * (m * n * k) as f64)).clamp(3.0, 200.0) as usize;
        let t = Instant::now();
        for _ in 0..reps {
            pool.install(|| run(&mut y));
        }
        let s = t.elapsed().as_secs_f64() / reps as f64;
        println!("m={m} n={n} k={k}: {:.1} GFLOP/s", 2.0 * (m * n * k) as f64 / s / 1e9);
    }
}
