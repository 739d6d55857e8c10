//! tern's embeddings against sentence-transformers on the tiny random checkpoints made by
//! scripts/make_goldens.py: both architectures, f32 and bf16 weight files, single inputs,
//! mixed-length batches, every prompt name and several Matryoshka sizes.

mod common;

use common::*;
use serde_json::Value;
use tern::runtime::embed::{EmbedOptions, Embedder, LoadOptions};

fn check_fixture(name: &str, min_checked: usize) {
    let dir = fixtures().join(name);
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let model = Embedder::load(&dir.join("model"), &LoadOptions { threads: 2, ..LoadOptions::default() }).unwrap();
    assert_eq!(model.dim() as u64, expected["dim"].as_u64().unwrap());
    let mut alone: Vec<(String, Vec<f32>)> = Vec::new();
    let mut checked = 0;
    for case in expected["cases"].as_array().unwrap() {
        let kind = case["kind"].as_str().unwrap();
        let opts = EmbedOptions {
            prompt_name: case["prompt_name"].as_str().map(String::from),
            dimensions: case["dims"].as_u64().map(|d| d as usize),
            ..EmbedOptions::default()
        };
        let items = case["items"].as_array().unwrap();
        let texts: Vec<&str> = items.iter().map(|i| i["text"].as_str().unwrap()).collect();
        let (token_ids, _) = model.tokenize(&texts, &opts).unwrap();
        for (item, got) in items.iter().zip(&token_ids) {
            assert_eq!(got, &ids(&item["token_ids"]), "{name} {kind}: token ids of {:?}", item["text"]);
        }
        let rows: Vec<Vec<f32>> = if kind == "alone" {
            texts.iter().map(|t| model.embed(&[t], &opts).unwrap().row(0).to_vec()).collect()
        } else {
            let out = model.embed(&texts, &opts).unwrap();
            (0..texts.len()).map(|i| out.row(i).to_vec()).collect()
        };
        for (i, (item, got)) in items.iter().zip(&rows).enumerate() {
            let what = format!("{name} {kind} prompt={:?} dims={:?} item {i} {:?}", opts.prompt_name, opts.dimensions, texts[i]);
            assert_close(got, &floats(&item["embedding"]), &what);
            checked += 1;
        }
        if kind == "alone" {
            alone = texts.iter().map(|t| t.to_string()).zip(rows).collect();
        } else if kind == "batch" {
            // Batch invariance: a member of a mixed-length batch equals the same text alone.
            for (t, row) in texts.iter().zip(&rows) {
                let single = &alone.iter().find(|(a, _)| a == t).expect("alone case first").1;
                assert_close(row, single, &format!("{name}: batch member {t:?} vs alone"));
            }
        }
    }
    assert!(checked >= min_checked, "{name}: only {checked} embeddings checked");
}

#[test]
fn egemma2_f32_weights() {
    check_fixture("egemma2-tiny-f32", 52);
}

#[test]
fn egemma2_bf16_weights() {
    check_fixture("egemma2-tiny-bf16", 52);
}

#[test]
fn egemma300m_f32_weights() {
    check_fixture("egemma300m-tiny-f32", 52);
}

#[test]
fn egemma300m_bf16_weights() {
    check_fixture("egemma300m-tiny-bf16", 52);
}

#[test]
fn egemma2_composite_checkpoint() {
    // The `embedding_gemma2` layout: text config nested, weights under `language_model.`.
    check_fixture("egemma2-tiny-composite", 14);
}
