//! Counters, gauges and histograms for `GET /metrics`, in Prometheus' text exposition format.
//! A handful of fixed series is all the server reports, so they are atomics written by hand
//! rather than a metrics framework.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A histogram with fixed upper bounds; the sum is kept in micro-units to stay an integer.
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum_micro: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micro: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if v <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micro.fetch_add((v.max(0.0) * 1e6) as u64, Ordering::Relaxed);
    }

    fn write(&self, out: &mut String, name: &str, labels: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {}", c.load(Ordering::Relaxed));
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum_micro.load(Ordering::Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{braces} {n}");
    }
}

const LATENCY_BOUNDS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const BATCH_BOUNDS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
const TOKEN_BOUNDS: &[f64] = &[16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0];

pub struct Metrics {
    /// (endpoint, status) → count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    latency: Mutex<BTreeMap<String, Histogram>>,
    pub in_flight: AtomicU64,
    pub rejected_busy: AtomicU64,
    /// Jobs waiting for an embedding worker or a decode slot.
    pub queue_depth: AtomicU64,
    pub embedding_batch_sequences: Histogram,
    pub embedding_batch_tokens: Histogram,
    pub decode_batch_sequences: Histogram,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub embedding_tokens: AtomicU64,
    /// Generated tokens per second over the last scheduler interval, ×1000.
    pub decode_tokens_per_s_milli: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            latency: Mutex::new(BTreeMap::new()),
            in_flight: AtomicU64::new(0),
            rejected_busy: AtomicU64::new(0),
            queue_depth: AtomicU64::new(0),
            embedding_batch_sequences: Histogram::new(BATCH_BOUNDS),
            embedding_batch_tokens: Histogram::new(TOKEN_BOUNDS),
            decode_batch_sequences: Histogram::new(BATCH_BOUNDS),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            embedding_tokens: AtomicU64::new(0),
            decode_tokens_per_s_milli: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn record_request(&self, endpoint: &str, status: u16, seconds: f64) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_default() += 1;
        }
        if let Ok(mut m) = self.latency.lock() {
            m.entry(endpoint.to_string()).or_insert_with(|| Histogram::new(LATENCY_BOUNDS)).observe(seconds);
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# HELP tern_requests_total Requests answered, by endpoint and HTTP status.\n# TYPE tern_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(out, "tern_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
            }
        }
        if let Ok(m) = self.latency.lock() {
            let _ = writeln!(out, "# HELP tern_request_duration_seconds Time from request to the last byte of the answer.\n# TYPE tern_request_duration_seconds histogram");
            for (endpoint, h) in m.iter() {
                let mut s = String::new();
                h.write(&mut s, "tern_request_duration_seconds", &format!("endpoint=\"{endpoint}\""), "");
                // One HELP/TYPE header for all endpoints.
                out.extend(s.lines().skip(2).map(|l| format!("{l}\n")));
            }
        }
        let gauge = |out: &mut String, name: &str, help: &str, v: f64, kind: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        gauge(&mut out, "tern_requests_in_flight", "Requests being served now.", load(&self.in_flight), "gauge");
        gauge(&mut out, "tern_requests_rejected_busy_total", "Requests refused with 429 at the concurrency limit.", load(&self.rejected_busy), "counter");
        gauge(&mut out, "tern_queue_depth", "Jobs waiting for an embedding batch or a decode slot.", load(&self.queue_depth), "gauge");
        gauge(&mut out, "tern_prompt_tokens_total", "Prompt tokens run by the LLMs.", load(&self.prompt_tokens), "counter");
        gauge(&mut out, "tern_completion_tokens_total", "Tokens generated.", load(&self.completion_tokens), "counter");
        gauge(&mut out, "tern_embedding_tokens_total", "Tokens embedded.", load(&self.embedding_tokens), "counter");
        gauge(&mut out, "tern_decode_tokens_per_second", "Generated tokens per second over the last decode round.", load(&self.decode_tokens_per_s_milli) / 1000.0, "gauge");
        self.embedding_batch_sequences.write(&mut out, "tern_embedding_batch_sequences", "", "Sequences per embedding batch.");
        self.embedding_batch_tokens.write(&mut out, "tern_embedding_batch_tokens", "", "Tokens per embedding batch.");
        self.decode_batch_sequences.write(&mut out, "tern_decode_batch_sequences", "", "Sequences advanced per decode round.");
        out
    }
}
