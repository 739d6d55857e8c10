//! Times one decode round of B sequences through `Qwen35::forward_batch` (the server's
//! continuous-batching step): `cargo run --release --example batch_decode -- MODEL [B...]`.

use std::time::Instant;

use tern::models::qwen35::Qwen35;

fn main() -> tern::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: batch_decode MODEL [B...]");
    let batches: Vec<usize> = args.map(|a| a.parse().expect("batch size")).collect();
    let model = Qwen35::load(path.as_ref())?;
    for &b in if batches.is_empty() { &[1usize, 2, 4, 8][..] } else { &batches[..] } {
        let mut states: Vec<_> = (0..b).map(|_| model.new_state()).collect::<tern::Result<Vec<_>>>()?;
        let prompt: Vec<u32> = (0..16).map(|i| 1000 + i * 17).collect();
        for s in states.iter_mut() {
            model.forward(&prompt, s)?;
        }
        let mut times = Vec::new();
        for step in 0..24u32 {
            let toks: Vec<[u32; 1]> = (0..b as u32).map(|i| [2000 + step * 31 + i]).collect();
            let mut batch: Vec<(&[u32], &mut _)> = toks.iter().map(|t| t.as_slice()).zip(states.iter_mut()).collect();
            let t = Instant::now();
            model.forward_batch(&mut batch)?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let round = times[times.len() / 2];
        println!("B={b}: round {:.1} ms, {:.1} tokens/s", round * 1e3, b as f64 / round);
    }
    Ok(())
}
