#![allow(dead_code)]
//! Helpers shared by the integration tests.

use std::path::PathBuf;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures")
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).abs()).fold(0.0, f64::max)
}

/// The embedding bounds of the numerics contract: cosine ≥ 0.99999 and max |Δ| ≤ 1e-5.
pub fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: dimension {} vs {}", got.len(), want.len());
    let c = cosine(got, want);
    let d = max_abs_diff(got, want);
    assert!(c >= 0.99999 && d <= 1e-5, "{what}: cosine {c:.8}, max |Δ| {d:.3e}");
}

pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// Reads a little-endian float32 `.npy` file (C order): (shape, data).
pub fn read_npy_f32(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{}: not an npy file", path.display());
    let (header_len, start) = if bytes[6] == 1 {
        (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10)
    } else {
        (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12)
    };
    let header = std::str::from_utf8(&bytes[start..start + header_len]).unwrap();
    assert!(header.contains("'<f4'") && header.contains("'fortran_order': False"), "{header}");
    let shape_str = header.split("'shape': (").nth(1).unwrap().split(')').next().unwrap();
    let shape: Vec<usize> = shape_str.split(',').filter(|s| !s.trim().is_empty()).map(|s| s.trim().parse().unwrap()).collect();
    let data: Vec<f32> = bytes[start + header_len..].chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(data.len(), shape.iter().product::<usize>());
    (shape, data)
}

/// The Qwen3.5 goldens' index (scripts/make_qwen35_goldens.py).
pub fn qwen35_index() -> serde_json::Value {
    let path = fixtures().join("qwen35").join("index.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A Qwen3.5 golden model: its safetensors directory (`gguf` None) or one of its GGUF files
/// (`f32`, `bf16`, `q8_0`).
pub fn qwen35_model(index: &serde_json::Value, name: &str, gguf: Option<&str>) -> PathBuf {
    let entry = &index["models"][name];
    let rel = match gguf {
        None => entry["hf_dir"].as_str(),
        Some(kind) => entry["gguf"][kind]["file"].as_str(),
    };
    fixtures().join("qwen35").join(rel.unwrap())
}

/// max |got − want| over the row's logit scale (max |want|): the measure of the LLM goldens.
pub fn relative_to_scale(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
    max_abs_diff(got, want) / scale
}

/// Index of the largest value (the first on a tie), as greedy decoding picks it.
pub fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}
