//! Qwen3.5 dense models from Hugging Face safetensors against transformers (greedy generation
//! of 16 tokens after prompts of 1, 63, 64, 65 and 300 tokens; scripts/make_qwen35_goldens.py):
//! the same token ids, and at every step logits within 1e-4 of the reference relative to the
//! logit scale (max |Δ| / max |logit|). The same goldens hold for the F32 and BF16 GGUFs made by
//! llama.cpp's converter: the random weights were drawn bf16-exact, so both files carry exactly
//! the checkpoint's values, in llama.cpp's layout (baked +1 norms, −exp(A_log), tiled value heads).

mod common;

use common::*;
use tern::models::qwen35::Qwen35;

/// `gguf`: None for the safetensors directory, else the GGUF variant (f32, bf16).
fn check_model(name: &str, gguf: Option<&str>) {
    let root = fixtures().join("qwen35");
    let index = qwen35_index();
    let entry = &index["models"][name];
    let model = Qwen35::load(&qwen35_model(&index, name, gguf)).unwrap();
    let name = &format!("{name} {}", gguf.unwrap_or("safetensors"));
    let mut worst = 0.0f64;
    let cases = entry["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        // Q8_0 has goldens of its own: the file's dequantized weights run in f32 by transformers,
        // with their own greedy path (Q8_0 leaves the F32 path within a few tokens here).
        let golden = if gguf == Some("q8_0") { &case["q8_0"] } else { case };
        let prompt = ids(&case["prompt_ids"]);
        let generated = ids(&golden["generated_ids"]);
        let (shape, want) = read_npy_f32(&root.join(golden["logits"].as_str().unwrap()));
        let vocab = shape[1];
        let mut state = model.new_state().unwrap();
        let mut input = prompt.clone();
        for (step, &want_id) in generated.iter().enumerate() {
            let logits = model.forward(&input, &mut state).unwrap();
            let row = &want[step * vocab..(step + 1) * vocab];
            let err = relative_to_scale(&logits, row);
            worst = worst.max(err);
            assert!(err <= 1e-4, "{name} prompt {} step {step}: relative logit error {err:.3e}", prompt.len());
            assert_eq!(argmax(&logits), want_id, "{name} prompt {} step {step}: greedy token", prompt.len());
            input = vec![want_id];
        }
    }
    eprintln!("{name}: worst relative logit error {worst:.3e}");
}

#[test]
fn dense_untied_from_safetensors() {
    check_model("dense-untied", None);
}

#[test]
fn dense_tied_from_safetensors() {
    check_model("dense-tied", None);
}

#[test]
fn dense_untied_from_gguf_f32_and_bf16() {
    check_model("dense-untied", Some("f32"));
    check_model("dense-untied", Some("bf16"));
}

#[test]
fn dense_tied_from_gguf_f32_and_bf16() {
    check_model("dense-tied", Some("f32"));
    check_model("dense-tied", Some("bf16"));
}

#[test]
fn dense_from_gguf_q8_0() {
    // tern decodes Q8_0 to f32 (d·q, as gguf's dequantize does), so the f32-mode bound holds.
    check_model("dense-untied", Some("q8_0"));
    check_model("dense-tied", Some("q8_0"));
}

#[test]
fn moe_from_safetensors_and_gguf() {
    check_model("moe", None);
    check_model("moe", Some("f32"));
    check_model("moe", Some("bf16"));
    check_model("moe", Some("q8_0"));
}

#[test]
fn bad_files_are_named() {
    let root = fixtures().join("qwen35");
    // A truncated GGUF is an error naming the file.
    let bytes = std::fs::read(root.join("dense-untied/gguf/dense-untied-f32.gguf")).unwrap();
    let cut = std::env::temp_dir().join(format!("tern-cut-{}.gguf", std::process::id()));
    std::fs::write(&cut, &bytes[..bytes.len() / 3]).unwrap();
    let err = Qwen35::load(&cut).err().expect("a truncated file must be refused").to_string();
    assert!(err.contains("tern-cut-"), "{err}");
}
