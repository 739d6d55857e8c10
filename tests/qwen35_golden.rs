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
    check_model_at(name, &qwen35_model(&qwen35_index(), name, gguf), gguf.unwrap_or("safetensors"), gguf == Some("q8_0"));
}

/// The goldens of fixture model `name` (the Q8_0 file's own with `q8`) against the model at
/// `path`, named `form` in messages.
fn check_model_at(name: &str, path: &std::path::Path, form: &str, q8: bool) -> Qwen35<tern::kernels::backend::CpuOps> {
    let root = fixtures().join("qwen35");
    let index = qwen35_index();
    let entry = &index["models"][name];
    let model = Qwen35::load(path).unwrap();
    let name = &format!("{name} {form}");
    let mut worst = 0.0f64;
    let cases = entry["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        // Q8_0 has goldens of its own: the file's dequantized weights run in f32 by transformers,
        // with their own greedy path (Q8_0 leaves the F32 path within a few tokens here).
        let golden = if q8 { &case["q8_0"] } else { case };
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
    model
}

/// A copy of fixture checkpoint `name` with every tensor whose values are all bf16-exact (the
/// random weights were drawn so) stored as BF16, in a fresh temporary directory.
fn bf16_copy(name: &str) -> std::path::PathBuf {
    use safetensors::tensor::{Dtype, SafeTensors, TensorView};
    let src = qwen35_model(&qwen35_index(), name, None);
    let dir = std::env::temp_dir().join(format!("tern-bf16-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (tname, t) in st.tensors() {
        assert_eq!(t.dtype(), Dtype::F32, "{tname}: the fixtures are f32");
        let values: Vec<f32> = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let exact = values.iter().all(|&v| half::bf16::from_f32(v).to_f32().to_bits() == v.to_bits());
        if exact {
            let data = values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
            out.push((tname, Dtype::BF16, t.shape().to_vec(), data));
        } else {
            out.push((tname, Dtype::F32, t.shape().to_vec(), t.data().to_vec()));
        }
    }
    assert!(out.iter().filter(|t| t.1 == Dtype::BF16).count() > out.len() / 2, "{name}: most tensors become bf16");
    let views: Vec<(String, TensorView)> =
        out.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
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

/// d_k = d_v = 32, the smallest state the CUDA scan takes: the same goldens on the CPU, and on
/// the GPU the checkpoint whose decode runs the fused recurrence (qwen35_cuda_tests).
#[test]
fn dense_scan_from_safetensors_and_gguf() {
    check_model("dense-scan", None);
    check_model("dense-scan", Some("bf16"));
    check_model("dense-scan", Some("q8_0"));
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

/// A bf16 checkpoint (Hugging Face's usual form) meets the same goldens, its matrices kept as
/// bf16: half the f32 checkpoint's weight bytes.
#[test]
fn dense_and_moe_from_bf16_safetensors() {
    for name in ["dense-untied", "moe"] {
        let dir = bf16_copy(name);
        let bf16 = check_model_at(name, &dir, "bf16 safetensors", false);
        let f32 = Qwen35::load(&qwen35_model(&qwen35_index(), name, None)).unwrap();
        assert_eq!(2 * bf16.weight_bytes(), f32.weight_bytes(), "{name}: bf16 matrices stay bf16");
        std::fs::remove_dir_all(&dir).unwrap();
    }
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
