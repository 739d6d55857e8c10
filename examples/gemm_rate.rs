//! Measures the f32 matrix-product rate of the CPU kernel on projection shapes, the compute
//! roofline that the embedding benchmark is read against.

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    for (m, n, k) in [(4096, 1152, 768), (4096, 768, 1152), (4096, 768, 768), (4096, 256, 768), (16, 1152, 768)] {
        let reps = (2e10 / (2.0 * (m * n * k) as f64)).clamp(3.0, 200.0) as usize;
        let rate = pool.install(|| tern::kernels::matmul::measure_rate(m, n, k, reps)).unwrap();
        println!("m={m} n={n} k={k}: {:.1} GFLOP/s", rate / 1e9);
    }
}
