//! Choosing the next token from the logits: penalties, then temperature, top-k, top-p and min-p
//! in the order transformers applies its logits processors, then a draw from a seeded generator,
//! so a seed reproduces a run exactly. Temperature 0 is greedy (the lowest id wins a tie, like
//! `argmax`).

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::kernels::sample::{LogitsWant, StepLogits, MAX_BEST};

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SamplingOptions {
    /// 0 is greedy; otherwise logits are divided by it before the filters.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p (1: no limit).
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one (0: off).
    pub min_p: f32,
    /// transformers' repetition penalty over every token seen (prompt included): a positive logit
    /// is divided by it, a negative one multiplied (1: off).
    pub repeat_penalty: f32,
    /// OpenAI's presence penalty over generated tokens: subtracted once from each token that
    /// occurred (0: off).
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty over generated tokens: subtracted per occurrence (0: off).
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingOptions {
    /// llama.cpp's defaults, which users of GGUF files know.
    fn default() -> Self {
        SamplingOptions {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingOptions {
    pub fn greedy() -> Self {
        SamplingOptions { temperature: 0.0, ..Default::default() }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Input(format!("sampling: {what}")));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(&format!("temperature {} must be a finite number >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(&format!("top-p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(&format!("min-p {} must be in [0, 1]", self.min_p));
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return bad(&format!("repeat penalty {} must be a finite number > 0", self.repeat_penalty));
        }
        for (name, v) in [("presence", self.presence_penalty), ("frequency", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(&format!("{name} penalty {v} must be in [-2, 2]"));
            }
        }
        Ok(())
    }
}

pub struct Sampler {
    opts: SamplingOptions,
    rng: Xoshiro256,
    /// Scratch: candidate (id, logit) pairs.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(opts: SamplingOptions) -> Result<Sampler> {
        opts.validate()?;
        let rng = Xoshiro256::seeded(opts.seed);
        Ok(Sampler { opts, rng, candidates: Vec::new() })
    }

    /// Picks a token from `logits` (modified in place by the penalties). `seen` is every token of
    /// the sequence so far, `generated` the part this request produced.
    pub fn sample(&mut self, logits: &mut [f32], seen: &[u32], generated: &[u32]) -> u32 {
        let o = &self.opts;
        if o.repeat_penalty != 1.0 {
            let mut done = std::collections::HashSet::new();
            for &id in seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    if done.insert(id) {
                        *l = if *l > 0.0 { *l / o.repeat_penalty } else { *l * o.repeat_penalty };
                    }
                }
            }
        }
        if o.presence_penalty != 0.0 || o.frequency_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &id in generated {
                *counts.entry(id).or_default() += 1;
            }
            for (id, n) in counts {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= o.presence_penalty + o.frequency_penalty * n as f32;
                }
            }
        }
        if self.greedy() {
            return argmax(logits);
        }
        // Candidates sorted by logit, most likely first (ties: lower id first, deterministic).
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| (i as u32, l / o.temperature)));
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if o.top_k > 0 && o.top_k < c.len() {
            c.select_nth_unstable_by(o.top_k - 1, by_logit);
            c.truncate(o.top_k);
        }
        c.sort_unstable_by(by_logit);
        self.draw()
    }

    /// Whether this sampler takes the most likely token (temperature 0, or top-k 1).
    fn greedy(&self) -> bool {
        self.opts.temperature == 0.0 || self.opts.top_k == 1
    }

    /// What this sampler reads of a step's logits: only the best entries when its choice
    /// depends on nothing else — greedy, or top-k (at most [`MAX_BEST`]) without penalties, in
    /// the order its candidates take (logit / temperature, then id) — else the whole row.
    pub fn wants(&self) -> LogitsWant {
        let o = &self.opts;
        if o.repeat_penalty != 1.0 || o.presence_penalty != 0.0 || o.frequency_penalty != 0.0 {
            return LogitsWant::Full;
        }
        if self.greedy() {
            return LogitsWant::ARGMAX;
        }
        match o.top_k {
            1..=MAX_BEST => LogitsWant::Best { divisor: o.temperature, count: o.top_k },
            _ => LogitsWant::Full,
        }
    }

    /// [`Sampler::sample`] of a step's logits as they came: the whole row, or the best entries
    /// that [`Sampler::wants`] asked for (the same token as from the whole row).
    pub fn sample_step(&mut self, logits: StepLogits, seen: &[u32], generated: &[u32]) -> u32 {
        let best = match logits {
            StepLogits::Full(mut row) => return self.sample(&mut row, seen, generated),
            StepLogits::Best(best) => best,
        };
        // Best entries stand for the row only where this sampler asked for them (no penalties,
        // greedy or top-k): callers ask with `wants`.
        debug_assert!(matches!(self.wants(), LogitsWant::Best { .. }), "best entries handed to a sampler that reads the whole row");
        let o = &self.opts;
        if self.greedy() {
            // argmax: the first maximum, or id 0 when nothing beats -inf.
            return best.first().filter(|e| e.1 > f32::NEG_INFINITY).map_or(0, |e| e.0);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(best.iter().take(o.top_k.max(1)));
        self.draw()
    }

    /// A draw among the candidates (sorted, most likely first, already cut to top-k) after
    /// top-p and min-p.
    fn draw(&mut self) -> u32 {
        let o = &self.opts;
        let c = &self.candidates;
        // No candidate: every logit was NaN (argmax's answer, id 0).
        let Some(&(best, max)) = c.first() else { return 0 };
        // Softmax in f64: the cumulative sums of top-p must not drift over a 248k vocabulary.
        let mut probs: Vec<f64> = c.iter().map(|&(_, l)| ((l - max) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let mut keep = probs.len();
        if o.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, p) in probs.iter().enumerate() {
                cum += p;
                if cum >= o.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if o.min_p > 0.0 {
            let floor = probs[0] * o.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&p| p >= floor).count().max(1));
        }
        let kept = &probs[..keep];
        let mass: f64 = kept.iter().sum();
        let mut u = self.rng.next_f64() * mass;
        for (i, p) in kept.iter().enumerate() {
            u -= p;
            if u < 0.0 {
                return c[i].0;
            }
        }
        // Rounding left u at or just above zero: the last kept token.
        c.get(keep - 1).map_or(best, |x| x.0)
    }
}

/// Index of the largest logit; the first one on a tie; NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// xoshiro256** (Blackman and Vigna), seeded through splitmix64: a few lines, so the sampler
/// needs no dependency and a seed means the same stream on every platform and version.
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn seeded(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Xoshiro256 { s: [next(), next(), next(), next()] }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1), 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 3.0, -1.0, 0.5]
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingOptions::greedy()).unwrap();
        assert_eq!(s.sample(&mut logits(), &[], &[]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 2);
    }

    #[test]
    fn a_seed_reproduces_the_draws() {
        let opts = SamplingOptions { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 7, ..Default::default() };
        let draw = |o: &SamplingOptions| {
            let mut s = Sampler::new(o.clone()).unwrap();
            (0..64).map(|_| s.sample(&mut logits(), &[], &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(&opts), draw(&opts));
        assert_ne!(draw(&opts), draw(&SamplingOptions { seed: 8, ..opts.clone() }));
    }

    #[test]
    fn draws_follow_the_softmax() {
        let opts = SamplingOptions { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 1, ..Default::default() };
        let mut s = Sampler::new(opts).unwrap();
        let base = logits();
        let mut counts = [0usize; 6];
        let n = 200_000;
        for _ in 0..n {
            counts[s.sample(&mut base.clone(), &[], &[]) as usize] += 1;
        }
        let z: f64 = base.iter().map(|&l| (l as f64).exp()).sum();
        for (i, &l) in base.iter().enumerate() {
            let p = (l as f64).exp() / z;
            let got = counts[i] as f64 / n as f64;
            // 5 standard deviations of a binomial proportion.
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            assert!((got - p).abs() < 5.0 * sd + 1e-4, "token {i}: {got} vs {p}");
        }
    }

    #[test]
    fn filters_limit_the_candidates() {
        let sample_set = |o: SamplingOptions| {
            let mut s = Sampler::new(o).unwrap();
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..2000 {
                seen.insert(s.sample(&mut logits(), &[], &[]));
            }
            seen.into_iter().collect::<Vec<_>>()
        };
        let base = SamplingOptions { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 3, ..Default::default() };
        assert_eq!(sample_set(base.clone()), vec![0, 1, 2, 3, 4, 5]);
        // top-k 3: the two 3.0s and the 2.0.
        assert_eq!(sample_set(SamplingOptions { top_k: 3, ..base.clone() }), vec![1, 2, 3]);
        // p(3.0) = 0.39 each: top-p 0.5 needs both.
        assert_eq!(sample_set(SamplingOptions { top_p: 0.5, ..base.clone() }), vec![1, 3]);
        // min-p 0.3: exp(2-3) = 0.37 passes, exp(1-3) = 0.14 does not.
        assert_eq!(sample_set(SamplingOptions { min_p: 0.3, ..base.clone() }), vec![1, 2, 3]);
    }

    /// A sampler fed the best entries it asks for draws the same tokens, from the same seed,
    /// as one fed the whole row: random rows with ties, NaN, infinities and signed zeros, for
    /// greedy and top-k options (with top-p and min-p after them).
    #[test]
    fn best_entries_draw_what_the_whole_row_draws() {
        use crate::kernels::sample::best_entries;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let options = [
            SamplingOptions::greedy(),
            SamplingOptions { temperature: 0.7, top_k: 1, ..Default::default() },
            SamplingOptions { seed: 5, ..Default::default() },
            SamplingOptions { temperature: 1.3, top_k: 5, top_p: 1.0, min_p: 0.0, seed: 9, ..Default::default() },
            SamplingOptions { temperature: 0.9, top_k: MAX_BEST, top_p: 0.9, min_p: 0.02, seed: 2, ..Default::default() },
        ];
        for o in options {
            let LogitsWant::Best { divisor, count } = Sampler::new(o.clone()).unwrap().wants() else {
                panic!("{o:?} should read only the best entries")
            };
            let (mut full, mut best) = (Sampler::new(o.clone()).unwrap(), Sampler::new(o.clone()).unwrap());
            for round in 0..200 {
                let n = 1 + (next() % 600) as usize;
                // Coarse values make ties; a few specials.
                let mut row: Vec<f32> = (0..n).map(|_| ((next() % 41) as f32 - 20.0) * 0.25).collect();
                for _ in 0..(next() % 4) {
                    let at = (next() % n as u64) as usize;
                    row[at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.0][(next() % 5) as usize];
                }
                if round % 50 == 0 {
                    row.iter_mut().for_each(|v| *v = f32::NAN);
                }
                let entries = best_entries(&row, divisor, count);
                let want = full.sample(&mut row.clone(), &[], &[]);
                let got = best.sample_step(StepLogits::Best(entries), &[], &[]);
                assert_eq!(got, want, "{o:?}, round {round}: {row:?}");
            }
        }
        // Penalties and unlimited top-k need the whole row.
        for o in [
            SamplingOptions { repeat_penalty: 1.1, ..SamplingOptions::greedy() },
            SamplingOptions { presence_penalty: 0.5, ..Default::default() },
            SamplingOptions { top_k: 0, ..Default::default() },
            SamplingOptions { top_k: MAX_BEST + 1, ..Default::default() },
        ] {
            assert_eq!(Sampler::new(o).unwrap().wants(), LogitsWant::Full);
        }
    }

    #[test]
    fn penalties_move_logits() {
        let mut s = Sampler::new(SamplingOptions { repeat_penalty: 2.0, ..SamplingOptions::greedy() }).unwrap();
        let mut l = logits();
        // Token 1 and 3 seen: 3.0 -> 1.5 for both; 2.0 wins. Repeats count once.
        assert_eq!(s.sample(&mut l, &[1, 3, 3, 4], &[]), 2);
        assert_eq!(l[4], -2.0);
        let mut s = Sampler::new(SamplingOptions { frequency_penalty: 0.6, presence_penalty: 0.5, ..SamplingOptions::greedy() }).unwrap();
        let mut l = logits();
        assert_eq!(s.sample(&mut l, &[], &[1, 3, 3]), 2);
        assert!((l[3] - (3.0 - 0.5 - 1.2)).abs() < 1e-6);
    }

    #[test]
    fn bad_options_are_refused() {
        for o in [
            SamplingOptions { temperature: -1.0, ..Default::default() },
            SamplingOptions { top_p: 0.0, ..Default::default() },
            SamplingOptions { min_p: 1.5, ..Default::default() },
            SamplingOptions { repeat_penalty: 0.0, ..Default::default() },
            SamplingOptions { presence_penalty: 3.0, ..Default::default() },
        ] {
            assert!(Sampler::new(o).is_err());
        }
    }
}
