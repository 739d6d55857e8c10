//! Qwen3.5 dense models from Hugging Face safetensors against transformers (greedy generation
//! of 16 tokens after prompts of 1, 63, 64, 65 and 300 tokens; scripts/make_qwen35_goldens.py):
//! the same token ids, and at every step logits within 1e-4 of the reference relative to the
//! logit scale (max |Δ| / max |logit|).

mod common;

use common::*;
use serde_json::Value;
use tern::models::qwen35::Qwen35;

fn check_model(name: &str) {
    let root = fixtures().join("qwen35");
    let index: Value = serde_json::from_str(&std::fs::read_to_string(root.join("index.json")).unwrap()).unwrap();
    let entry = &index["models"][name];
    let model = Qwen35::load(&root.join(entry["hf_dir"].as_str().unwrap())).unwrap();
    let mut worst = 0.0f64;
    let cases = entry["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let prompt = ids(&case["prompt_ids"]);
        let generated = ids(&case["generated_ids"]);
        let (shape, want) = read_npy_f32(&root.join(case["logits"].as_str().unwrap()));
        let vocab = shape[1];
        let mut state = model.new_state();
        let mut input = prompt.clone();
        for (step, &want_id) in generated.iter().enumerate() {
            let logits = model.forward(&input, &mut state).unwrap();
            let row = &want[step * vocab..(step + 1) * vocab];
            let scale = row.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            let err = max_abs_diff(&logits, row) / scale;
            worst = worst.max(err);
            assert!(err <= 1e-4, "{name} prompt {} step {step}: relative logit error {err:.3e}", prompt.len());
            let argmax = logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
            assert_eq!(argmax as u32, want_id, "{name} prompt {} step {step}: greedy token", prompt.len());
            input = vec![want_id];
        }
    }
    eprintln!("{name}: worst relative logit error {worst:.3e}");
}

#[test]
fn dense_untied_from_safetensors() {
    check_model("dense-untied");
}

#[test]
fn dense_tied_from_safetensors() {
    check_model("dense-tied");
}
