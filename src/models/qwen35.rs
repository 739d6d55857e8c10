//! Qwen3.5 hybrid LLMs (`qwen3_5_text` / GGUF `qwen35`, dense; `qwen3_5_moe_text` / `qwen35moe`,
//! mixture of experts with a sigmoid-gated shared expert), from Hugging Face safetensors or
//! llama.cpp GGUF files: Gated DeltaNet
//! linear-attention layers interleaved with gated full attention (a layer is full attention iff
//! `(i + 1) % full_attention_interval == 0`), written once over the op set.
//!
//! Traps this file encodes (each checked by the golden test against transformers):
//! - HF norms are `(1 + w)` (added at load), except the GDN gated norm, which multiplies by `w`;
//! - `q_proj` holds `[query | gate]` interleaved per head; attention output × sigmoid(gate);
//! - RoPE rotates only the first `head_dim · partial_rotary_factor` channels (NeoX halves);
//!   the MRoPE sections collapse to plain RoPE for text (all three position ids are equal);
//! - GDN q, k are L2-normalised (eps 1e-6) and q is scaled by 1/√d_k; β = sigmoid(b);
//!   g = −exp(A_log)·softplus(a + dt_bias); value head h reads key head h / (nv/nk).
//! - GGUF (llama.cpp's converter): norms have the +1 baked in, except `ssm_norm`; `ssm_a` already
//!   holds −exp(A_log); value heads are stored in tiled order, so value head h reads key head
//!   h % nk — every value-head-indexed tensor is permuted alike, so using the tiled map on the
//!   stored order gives the HF result without undoing the permutation.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::formats::config::JsonFile;
use crate::formats::gguf::GgufFile;
use crate::formats::safetensors::SafetensorsWeights;
use crate::formats::{Matrix, Tensor};
use crate::kernels::activation::silu_mul;
use crate::kernels::attention::{causal_attention, AttentionShape};
use crate::kernels::gated_delta::{
    beta_gate, conv1d_silu_scan, decay_gate, delta_rule_chunked, delta_rule_scan, gated_rms_norm_inplace,
    normalize_qk, sigmoid, DeltaRuleHeads, DeltaRuleInputs, KeyHeadMap,
};
use crate::kernels::matmul::{linear_w, Weights};
use crate::kernels::norm::rms_norm;
use crate::kernels::rope::{head_prep, HeadPrep, RopeTable};
use crate::kernels::{pack, Segment};

#[derive(Clone, Debug)]
pub struct Qwen35Config {
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    /// Mixture of experts (`qwen3_5_moe_text` / `qwen35moe`); None for the dense models.
    pub moe: Option<MoeConfig>,
    pub n_layers: usize,
    pub full_attention_interval: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub eps: f32,
    pub lin_k_heads: usize,
    pub lin_v_heads: usize,
    pub lin_k_dim: usize,
    pub lin_v_dim: usize,
    pub conv_kernel: usize,
    pub max_positions: usize,
    pub tie_embeddings: bool,
    pub eos_ids: Vec<u32>,
    /// Which key head a value head reads: grouped in HF checkpoints, tiled in GGUF files.
    pub key_head: KeyHeadMap,
    /// Weight-name prefix (`model.` for the causal LM, `model.language_model.` in the wrappers).
    pub prefix: String,
}

#[derive(Clone, Debug)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub shared_intermediate: usize,
}

impl Qwen35Config {
    pub fn is_full_attention(&self, layer: usize) -> bool {
        (layer + 1) % self.full_attention_interval == 0
    }

    pub fn from_dir(dir: &Path) -> Result<Qwen35Config> {
        let top = JsonFile::read(&dir.join("config.json"))?;
        let model_type = top.str("model_type")?.to_string();
        let cfg = match model_type.as_str() {
            "qwen3_5_text" | "qwen3_5_moe_text" => top,
            "qwen3_5" | "qwen3_5_moe" => {
                top.sub("text_config").ok_or_else(|| Error::format(&top.path, "missing `text_config`"))?
            }
            other => {
                return Err(Error::unsupported(
                    &top.path,
                    format!("model_type `{other}` (Qwen3.5: qwen3_5_text, qwen3_5_moe_text and their wrappers)"),
                ))
            }
        };
        let moe = if model_type.starts_with("qwen3_5_moe") {
            Some(MoeConfig {
                experts: cfg.usize("num_experts")?,
                top_k: cfg.usize("num_experts_per_tok")?,
                expert_intermediate: cfg.usize("moe_intermediate_size")?,
                shared_intermediate: cfg.usize("shared_expert_intermediate_size")?,
            })
        } else {
            None
        };
        let act = cfg.opt_str("hidden_act")?.unwrap_or("silu");
        if act != "silu" {
            return Err(Error::unsupported(&cfg.path, format!("hidden_act `{act}` (silu is supported)")));
        }
        cfg.require_absent_or("attention_bias", &Value::Bool(false), "projections have no bias")?;
        let hidden = cfg.usize("hidden_size")?;
        let q_heads = cfg.usize("num_attention_heads")?;
        let head_dim = cfg.opt_usize("head_dim")?.unwrap_or(hidden / q_heads.max(1));
        let rope = cfg.sub("rope_parameters");
        let (theta, partial) = match &rope {
            Some(r) => {
                let kind = r.opt_str("rope_type")?.unwrap_or("default");
                if kind != "default" {
                    return Err(Error::unsupported(&cfg.path, format!("rope_type `{kind}`")));
                }
                (r.f64("rope_theta")?, r.opt_f64("partial_rotary_factor")?.unwrap_or(1.0))
            }
            None => (cfg.opt_f64("rope_theta")?.unwrap_or(1e7), cfg.opt_f64("partial_rotary_factor")?.unwrap_or(1.0)),
        };
        let rotary_dim = (head_dim as f64 * partial) as usize;
        let n_layers = cfg.usize("num_hidden_layers")?;
        let interval = cfg.opt_usize("full_attention_interval")?.unwrap_or(4).max(1);
        if let Some(types) = cfg.opt_str_list("layer_types")? {
            for (i, t) in types.iter().enumerate() {
                let want = if (i + 1) % interval == 0 { "full_attention" } else { "linear_attention" };
                if t != want {
                    return Err(Error::unsupported(&cfg.path, format!("layer {i} is `{t}`, the interval rule gives `{want}`")));
                }
            }
        }
        let eos_ids = match cfg.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect(),
            _ => vec![],
        };
        let c = Qwen35Config {
            vocab_size: cfg.usize("vocab_size")?,
            hidden,
            intermediate: if moe.is_some() { cfg.opt_usize("intermediate_size")?.unwrap_or(0) } else { cfg.usize("intermediate_size")? },
            moe,
            n_layers,
            full_attention_interval: interval,
            q_heads,
            kv_heads: cfg.usize("num_key_value_heads")?,
            head_dim,
            rotary_dim,
            rope_theta: theta,
            eps: cfg.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            lin_k_heads: cfg.usize("linear_num_key_heads")?,
            lin_v_heads: cfg.usize("linear_num_value_heads")?,
            lin_k_dim: cfg.usize("linear_key_head_dim")?,
            lin_v_dim: cfg.usize("linear_value_head_dim")?,
            conv_kernel: cfg.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
            max_positions: cfg.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_embeddings: cfg.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            eos_ids,
            key_head: KeyHeadMap::Grouped,
            prefix: if model_type == "qwen3_5" || model_type == "qwen3_5_moe" { "model.language_model.".into() } else { "model.".into() },
        };
        c.validate(&cfg.path)?;
        Ok(c)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        if self.kv_heads == 0 || self.q_heads % self.kv_heads != 0 || self.lin_k_heads == 0 || self.lin_v_heads % self.lin_k_heads != 0 {
            return Err(Error::unsupported(path, "head counts must divide: q over kv heads, value over key heads"));
        }
        if self.rotary_dim % 2 != 0 || self.rotary_dim > self.head_dim {
            return Err(Error::unsupported(
                path,
                format!("rotary dimension {} of a {}-channel head", self.rotary_dim, self.head_dim),
            ));
        }
        if let Some(m) = &self.moe {
            if m.top_k == 0 || m.top_k > m.experts {
                return Err(Error::unsupported(path, format!("top-{} routing over {} experts", m.top_k, m.experts)));
            }
        }
        if self.conv_kernel < 2 {
            return Err(Error::unsupported(path, format!("conv kernel width {}", self.conv_kernel)));
        }
        Ok(())
    }

    /// The config from a GGUF file's metadata (architecture `qwen35`); a missing key is named.
    pub fn from_gguf(f: &GgufFile) -> Result<Qwen35Config> {
        let arch = f.architecture()?.to_string();
        if arch != "qwen35" && arch != "qwen35moe" {
            return Err(Error::unsupported(f.path(), format!("GGUF architecture `{arch}` (supported: qwen35, qwen35moe)")));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let moe = if arch == "qwen35moe" {
            Some(MoeConfig {
                experts: f.get_usize(&key("expert_count"))?,
                top_k: f.get_usize(&key("expert_used_count"))?,
                expert_intermediate: f.get_usize(&key("expert_feed_forward_length"))?,
                shared_intermediate: f.get_usize(&key("expert_shared_feed_forward_length"))?,
            })
        } else {
            None
        };
        let head_dim = f.get_usize(&key("attention.key_length"))?;
        let lin_v_heads = f.get_usize(&key("ssm.time_step_rank"))?;
        let inner = f.get_usize(&key("ssm.inner_size"))?;
        let vocab = f.tensor_info("token_embd.weight").map(|t| t.shape()[0]).ok_or_else(|| Error::tensor("token_embd.weight", "missing from the GGUF"))?;
        let c = Qwen35Config {
            vocab_size: vocab,
            hidden: f.get_usize(&key("embedding_length"))?,
            intermediate: if moe.is_some() { f.opt_usize(&key("feed_forward_length"))?.unwrap_or(0) } else { f.get_usize(&key("feed_forward_length"))? },
            moe,
            // block_count includes an MTP block when the file has one: its tensors sit after the
            // main layers and carry their own keys, and the main pass stops before it.
            n_layers: f.get_usize(&key("block_count"))? - f.opt_usize(&key("nextn_predict_layers"))?.unwrap_or(0),
            full_attention_interval: f.get_usize(&key("full_attention_interval"))?,
            q_heads: f.get_usize(&key("attention.head_count"))?,
            kv_heads: f.get_usize(&key("attention.head_count_kv"))?,
            head_dim,
            rotary_dim: f.opt_usize(&key("rope.dimension_count"))?.unwrap_or(head_dim),
            rope_theta: f.get_f32(&key("rope.freq_base"))? as f64,
            eps: f.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            lin_k_heads: f.get_usize(&key("ssm.group_count"))?,
            lin_v_heads,
            lin_k_dim: f.get_usize(&key("ssm.state_size"))?,
            lin_v_dim: inner / lin_v_heads.max(1),
            conv_kernel: f.get_usize(&key("ssm.conv_kernel"))?,
            max_positions: f.get_usize(&key("context_length"))?,
            tie_embeddings: !f.contains("output.weight"),
            eos_ids: f.opt_usize("tokenizer.ggml.eos_token_id")?.map(|v| vec![v as u32]).unwrap_or_default(),
            key_head: KeyHeadMap::Tiled,
            prefix: String::new(),
        };
        c.validate(f.path())?;
        Ok(c)
    }
}

/// Where the weights come from; names are asked for in the Hugging Face spelling (without the
/// model prefix) and mapped to llama.cpp's for GGUF files.
enum Source<'f> {
    Hf(SafetensorsWeights),
    Gguf(&'f GgufFile),
}

fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "embed_tokens.weight" => Some("token_embd.weight"),
        "norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("layers.")?;
    let (layer, name) = rest.split_once('.')?;
    let g = match name {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "post_attention_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "mlp.gate.weight" => "ffn_gate_inp.weight",
        "mlp.shared_expert.gate_proj.weight" => "ffn_gate_shexp.weight",
        "mlp.shared_expert.up_proj.weight" => "ffn_up_shexp.weight",
        "mlp.shared_expert.down_proj.weight" => "ffn_down_shexp.weight",
        "mlp.shared_expert_gate.weight" => "ffn_gate_inp_shexp.weight",
        "linear_attn.in_proj_qkv.weight" => "attn_qkv.weight",
        "linear_attn.in_proj_z.weight" => "attn_gate.weight",
        "linear_attn.in_proj_b.weight" => "ssm_beta.weight",
        "linear_attn.in_proj_a.weight" => "ssm_alpha.weight",
        "linear_attn.conv1d.weight" => "ssm_conv1d.weight",
        "linear_attn.dt_bias" => "ssm_dt.bias",
        "linear_attn.A_log" => "ssm_a",
        "linear_attn.norm.weight" => "ssm_norm.weight",
        "linear_attn.out_proj.weight" => "ssm_out.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}"))
}

impl Source<'_> {
    fn get(&self, prefix: &str, hf: &str, shape: &[usize]) -> Result<Tensor> {
        match self {
            Source::Hf(w) => w.get(&format!("{prefix}{hf}"), shape),
            Source::Gguf(f) => {
                let name = gguf_name(hf).ok_or_else(|| Error::tensor(hf, "has no GGUF counterpart"))?;
                f.load_shaped(&name, shape)
            }
        }
    }

    /// A weight matrix: bf16 and Q8_0 GGUF tensors stay as stored, everything else is f32.
    fn matrix(&self, prefix: &str, hf: &str, shape: &[usize]) -> Result<Matrix> {
        match self {
            Source::Hf(_) => Ok(Matrix::F32(self.get(prefix, hf, shape)?)),
            Source::Gguf(f) => {
                let name = gguf_name(hf).ok_or_else(|| Error::tensor(hf, "has no GGUF counterpart"))?;
                f.load_matrix(&name, shape)
            }
        }
    }

    /// The experts of layer `layer`: one tensor per expert in HF checkpoints saved by
    /// transformers, stacked [experts][rows][cols] in GGUF (`ffn_{gate,up,down}_exps`).
    fn experts(&self, prefix: &str, layer: usize, ne: usize, ei: usize, h: usize) -> Result<Vec<Mlp>> {
        match self {
            Source::Hf(w) => (0..ne)
                .map(|e| {
                    let name = |m: &str| format!("{prefix}layers.{layer}.mlp.experts.{e}.{m}.weight");
                    Ok(Mlp {
                        gate: w.get(&name("gate_proj"), &[ei, h])?.into(),
                        up: w.get(&name("up_proj"), &[ei, h])?.into(),
                        down: w.get(&name("down_proj"), &[h, ei])?.into(),
                        width: ei,
                    })
                })
                .collect(),
            Source::Gguf(f) => {
                let stacked = |m: &str, rows: usize, cols: usize| -> Result<Vec<Matrix>> {
                    let name = format!("blk.{layer}.{m}");
                    let t = f.load_shaped(&name, &[ne, rows, cols])?;
                    Ok(t.data()
                        .chunks(rows * cols)
                        .enumerate()
                        .map(|(e, d)| Matrix::F32(Tensor::owned(format!("{name}[{e}]"), vec![rows, cols], d.to_vec())))
                        .collect())
                };
                let (g, u, d) = (stacked("ffn_gate_exps.weight", ei, h)?, stacked("ffn_up_exps.weight", ei, h)?, stacked("ffn_down_exps.weight", h, ei)?);
                Ok(g.into_iter().zip(u).zip(d).map(|((gate, up), down)| Mlp { gate, up, down, width: ei }).collect())
            }
        }
    }

    fn has_lm_head(&self) -> bool {
        match self {
            Source::Hf(w) => w.contains("lm_head.weight"),
            Source::Gguf(f) => f.contains("output.weight"),
        }
    }
}

/// The kernels' view of a weight matrix.
fn wts(m: &Matrix) -> Weights<'_> {
    match m {
        Matrix::F32(t) => Weights::F32(t.data()),
        Matrix::Bf16(t) => Weights::Bf16(t.data()),
        Matrix::Q8_0(t) => Weights::Q8_0(t.data()),
    }
}

struct LinearAttention {
    in_qkv: Matrix,
    in_z: Matrix,
    in_b: Matrix,
    in_a: Matrix,
    conv: Vec<f32>,
    dt_bias: Vec<f32>,
    /// −exp(A_log), computed once.
    a: Vec<f32>,
    norm: Vec<f32>,
    out: Matrix,
}

struct FullAttention {
    q_gate: Matrix,
    k: Matrix,
    v: Matrix,
    o: Matrix,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

enum Mixer {
    Linear(LinearAttention),
    Full(FullAttention),
}

struct Layer {
    mixer: Mixer,
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    ffn: Ffn,
}

/// A gated SiLU MLP: down(silu(gate·x) · up·x).
struct Mlp {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    width: usize,
}

impl Mlp {
    fn forward(&self, x: &[f32], n: usize, h: usize) -> Result<Vec<f32>> {
        let mut g = linear_w(x, n, wts(&self.gate), self.width, h)?;
        let u = linear_w(x, n, wts(&self.up), self.width, h)?;
        silu_mul(&mut g, &u)?;
        linear_w(&g, n, wts(&self.down), h, self.width)
    }
}

enum Ffn {
    Dense(Mlp),
    /// Router [experts][hidden] (softmax in f32 → top-k → renormalise), the experts, and the
    /// shared expert with its sigmoid gate [1][hidden].
    Moe { router: Matrix, experts: Vec<Mlp>, top_k: usize, shared: Mlp, shared_gate: Matrix },
}

impl Ffn {
    fn forward(&self, x: &[f32], n: usize, h: usize) -> Result<Vec<f32>> {
        let (router, experts, top_k, shared, shared_gate) = match self {
            Ffn::Dense(m) => return m.forward(x, n, h),
            Ffn::Moe { router, experts, top_k, shared, shared_gate } => (router, experts, *top_k, shared, shared_gate),
        };
        let ne = experts.len();
        let logits = linear_w(x, n, wts(router), ne, h)?;
        // Per expert: the tokens routed to it and their renormalised weights.
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); ne];
        for (t, row) in logits.chunks(ne).enumerate() {
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = row.iter().map(|&v| (v - mx).exp()).collect();
            let total: f32 = e.iter().sum();
            let probs: Vec<f32> = e.iter().map(|&v| v / total).collect();
            let mut order: Vec<usize> = (0..ne).collect();
            // Highest probability first; ties keep the lower expert index, as torch.topk does.
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            let top = &order[..top_k];
            let sum: f32 = top.iter().map(|&i| probs[i]).sum();
            for &i in top {
                routed[i].push((t, probs[i] / sum));
            }
        }
        let mut out = vec![0.0f32; n * h];
        for (expert, tokens) in experts.iter().zip(&routed) {
            if tokens.is_empty() {
                continue;
            }
            let gathered: Vec<f32> = tokens.iter().flat_map(|&(t, _)| x[t * h..(t + 1) * h].iter().copied()).collect();
            let y = expert.forward(&gathered, tokens.len(), h)?;
            for (row, &(t, w)) in y.chunks(h).zip(tokens) {
                out[t * h..(t + 1) * h].iter_mut().zip(row).for_each(|(o, &v)| *o += v * w);
            }
        }
        let s = shared.forward(x, n, h)?;
        let gate = linear_w(x, n, wts(shared_gate), 1, h)?;
        for t in 0..n {
            let g = sigmoid(gate[t]);
            out[t * h..(t + 1) * h].iter_mut().zip(&s[t * h..(t + 1) * h]).for_each(|(o, &v)| *o += g * v);
        }
        Ok(out)
    }
}

/// Per-sequence state: conv and recurrent state of each linear layer, KV cache of each full one.
pub struct Qwen35State {
    conv: Vec<Vec<f32>>,
    recurrent: Vec<Vec<f32>>,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    /// Tokens processed so far.
    pub position: usize,
}

pub struct Qwen35 {
    pub cfg: Qwen35Config,
    embed: Matrix,
    lm_head: Option<Matrix>,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    rope: RopeTable,
}

impl Qwen35 {
    /// Loads a Hugging Face checkpoint directory or a `.gguf` file.
    pub fn load(path: &Path) -> Result<Qwen35> {
        // A missing path is named as given, not as the config.json a directory would hold.
        std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if path.is_file() {
            return Self::from_gguf(&GgufFile::open(path)?);
        }
        Self::build(Qwen35Config::from_dir(path)?, Source::Hf(SafetensorsWeights::open_dir(path)?))
    }

    /// The model of an opened GGUF file (whose tokenizer the caller may read too).
    pub fn from_gguf(f: &GgufFile) -> Result<Qwen35> {
        Self::build(Qwen35Config::from_gguf(f)?, Source::Gguf(f))
    }

    fn build(cfg: Qwen35Config, w: Source) -> Result<Qwen35> {
        let gguf = matches!(w, Source::Gguf(_));
        let p = cfg.prefix.clone();
        let h = cfg.hidden;
        let mat = |name: &str, r: usize, c: usize| w.matrix(&p, name, &[r, c]);
        // (1 + w) norms: HF stores w, GGUF stores 1 + w already.
        let plus_one = |name: &str, d: usize| -> Result<Vec<f32>> {
            let t = w.get(&p, name, &[d])?;
            Ok(if gguf { t.data().to_vec() } else { t.data().iter().map(|&x| 1.0 + x).collect() })
        };
        let vec = |name: &str, d: usize| -> Result<Vec<f32>> { Ok(w.get(&p, name, &[d])?.data().to_vec()) };
        let (kd, vd) = (cfg.lin_k_heads * cfg.lin_k_dim, cfg.lin_v_heads * cfg.lin_v_dim);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let l = format!("layers.{i}.");
            let mixer = if cfg.is_full_attention(i) {
                let hd = cfg.head_dim;
                Mixer::Full(FullAttention {
                    q_gate: mat(&format!("{l}self_attn.q_proj.weight"), cfg.q_heads * hd * 2, h)?,
                    k: mat(&format!("{l}self_attn.k_proj.weight"), cfg.kv_heads * hd, h)?,
                    v: mat(&format!("{l}self_attn.v_proj.weight"), cfg.kv_heads * hd, h)?,
                    o: mat(&format!("{l}self_attn.o_proj.weight"), h, cfg.q_heads * hd)?,
                    q_norm: plus_one(&format!("{l}self_attn.q_norm.weight"), hd)?,
                    k_norm: plus_one(&format!("{l}self_attn.k_norm.weight"), hd)?,
                })
            } else {
                let conv_dim = 2 * kd + vd;
                // [channels][1][K] in HF, [channels][K] in GGUF: the same values in the same order.
                let conv_shape: &[usize] = if gguf { &[conv_dim, cfg.conv_kernel] } else { &[conv_dim, 1, cfg.conv_kernel] };
                let conv = w.get(&p, &format!("{l}linear_attn.conv1d.weight"), conv_shape)?.data().to_vec();
                let a_log = vec(&format!("{l}linear_attn.A_log"), cfg.lin_v_heads)?;
                Mixer::Linear(LinearAttention {
                    in_qkv: mat(&format!("{l}linear_attn.in_proj_qkv.weight"), conv_dim, h)?,
                    in_z: mat(&format!("{l}linear_attn.in_proj_z.weight"), vd, h)?,
                    in_b: mat(&format!("{l}linear_attn.in_proj_b.weight"), cfg.lin_v_heads, h)?,
                    in_a: mat(&format!("{l}linear_attn.in_proj_a.weight"), cfg.lin_v_heads, h)?,
                    conv,
                    dt_bias: vec(&format!("{l}linear_attn.dt_bias"), cfg.lin_v_heads)?,
                    // GGUF's ssm_a is −exp(A_log) already.
                    a: if gguf { a_log } else { a_log.iter().map(|&x| -x.exp()).collect() },
                    norm: vec(&format!("{l}linear_attn.norm.weight"), cfg.lin_v_dim)?,
                    out: mat(&format!("{l}linear_attn.out_proj.weight"), h, vd)?,
                })
            };
            layers.push(Layer {
                mixer,
                input_norm: plus_one(&format!("{l}input_layernorm.weight"), h)?,
                post_norm: plus_one(&format!("{l}post_attention_layernorm.weight"), h)?,
                ffn: match &cfg.moe {
                    None => Ffn::Dense(Mlp {
                        gate: mat(&format!("{l}mlp.gate_proj.weight"), cfg.intermediate, h)?,
                        up: mat(&format!("{l}mlp.up_proj.weight"), cfg.intermediate, h)?,
                        down: mat(&format!("{l}mlp.down_proj.weight"), h, cfg.intermediate)?,
                        width: cfg.intermediate,
                    }),
                    Some(moe) => {
                        let (ne, ei, si) = (moe.experts, moe.expert_intermediate, moe.shared_intermediate);
                        Ffn::Moe {
                            router: mat(&format!("{l}mlp.gate.weight"), ne, h)?,
                            experts: w.experts(&p, i, ne, ei, h)?,
                            top_k: moe.top_k,
                            shared: Mlp {
                                gate: mat(&format!("{l}mlp.shared_expert.gate_proj.weight"), si, h)?,
                                up: mat(&format!("{l}mlp.shared_expert.up_proj.weight"), si, h)?,
                                down: mat(&format!("{l}mlp.shared_expert.down_proj.weight"), h, si)?,
                                width: si,
                            },
                            shared_gate: mat(&format!("{l}mlp.shared_expert_gate.weight"), 1, h)?,
                        }
                    }
                },
            });
        }
        let embed = mat("embed_tokens.weight", cfg.vocab_size, h)?;
        let lm_head = if cfg.tie_embeddings && !w.has_lm_head() {
            None
        } else {
            // The head sits outside the model prefix in HF checkpoints.
            Some(w.matrix("", "lm_head.weight", &[cfg.vocab_size, h])?)
        };
        Ok(Qwen35 {
            rope: RopeTable::new(cfg.rope_theta, cfg.rotary_dim, cfg.max_positions),
            final_norm: plus_one("norm.weight", h)?,
            embed,
            lm_head,
            layers,
            cfg,
        })
    }

    /// Every weight matrix of the layers (per-token work), then the head.
    fn layer_matrices(&self) -> Vec<&Matrix> {
        let mut out = Vec::new();
        for l in &self.layers {
            match &l.mixer {
                Mixer::Linear(m) => out.extend([&m.in_qkv, &m.in_z, &m.in_b, &m.in_a, &m.out]),
                Mixer::Full(m) => out.extend([&m.q_gate, &m.k, &m.v, &m.o]),
            }
            match &l.ffn {
                Ffn::Dense(m) => out.extend([&m.gate, &m.up, &m.down]),
                Ffn::Moe { router, experts, shared, shared_gate, .. } => {
                    out.extend([router, shared_gate, &shared.gate, &shared.up, &shared.down]);
                    out.extend(experts.iter().flat_map(|e| [&e.gate, &e.up, &e.down]));
                }
            }
        }
        out
    }

    fn head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of all weight matrices as held (bf16 kept as stored counts 2 per value), embedding
    /// and head included once each.
    pub fn weight_bytes(&self) -> usize {
        let mut b: usize = self.layer_matrices().iter().map(|m| wts(m).bytes()).sum();
        b += wts(&self.embed).bytes();
        if let Some(h) = &self.lm_head {
            b += wts(h).bytes();
        }
        b
    }

    /// The fewest bytes one decode step at context `ctx` must read: every layer matrix (all
    /// experts for MoE counted as top-k of them), the head, one embedding row, the recurrent and
    /// conv state (read and written back) and the KV cache.
    pub fn decode_bytes_per_token(&self, ctx: usize) -> usize {
        let c = &self.cfg;
        let mut b = 0usize;
        for l in &self.layers {
            let ms: Vec<&Matrix> = match &l.mixer {
                Mixer::Linear(m) => vec![&m.in_qkv, &m.in_z, &m.in_b, &m.in_a, &m.out],
                Mixer::Full(m) => vec![&m.q_gate, &m.k, &m.v, &m.o],
            };
            b += ms.iter().map(|m| wts(m).bytes()).sum::<usize>();
            b += match &l.ffn {
                Ffn::Dense(m) => [&m.gate, &m.up, &m.down].iter().map(|m| wts(m).bytes()).sum::<usize>(),
                Ffn::Moe { router, experts, top_k, shared, shared_gate } => {
                    let one = experts.first().map_or(0, |e| [&e.gate, &e.up, &e.down].iter().map(|m| wts(m).bytes()).sum());
                    [router, shared_gate, &shared.gate, &shared.up, &shared.down].iter().map(|m| wts(m).bytes()).sum::<usize>()
                        + top_k * one
                }
            };
        }
        b += wts(self.head()).bytes() + 4 * c.hidden;
        let linear = (0..c.n_layers).filter(|&i| !c.is_full_attention(i)).count();
        let conv_dim = 2 * c.lin_k_heads * c.lin_k_dim + c.lin_v_heads * c.lin_v_dim;
        b += linear * 2 * 4 * (c.lin_v_heads * c.lin_v_dim * c.lin_k_dim + conv_dim * (c.conv_kernel - 1));
        b += (c.n_layers - linear) * 2 * 4 * ctx * c.kv_heads * c.head_dim;
        b
    }

    /// FLOPs of a prefill of `n` tokens from an empty state: the layer products for every
    /// token (MoE: top-k experts), causal attention (QKᵀ and PV over n(n+1)/2 pairs), the delta
    /// rule at its sequential count (≈ 6·d_k·d_v per value head and token), and the head for
    /// the last token.
    pub fn prefill_flops(&self, n: usize) -> f64 {
        let c = &self.cfg;
        let per_token: usize = self
            .layers
            .iter()
            .map(|l| {
                let mixer: usize = match &l.mixer {
                    Mixer::Linear(m) => [&m.in_qkv, &m.in_z, &m.in_b, &m.in_a, &m.out].iter().map(|m| wts(m).len()).sum(),
                    Mixer::Full(m) => [&m.q_gate, &m.k, &m.v, &m.o].iter().map(|m| wts(m).len()).sum(),
                };
                let ffn: usize = match &l.ffn {
                    Ffn::Dense(m) => [&m.gate, &m.up, &m.down].iter().map(|m| wts(m).len()).sum(),
                    Ffn::Moe { router, experts, top_k, shared, shared_gate } => {
                        let one: usize = experts.first().map_or(0, |e| [&e.gate, &e.up, &e.down].iter().map(|m| wts(m).len()).sum());
                        [router, shared_gate, &shared.gate, &shared.up, &shared.down].iter().map(|m| wts(m).len()).sum::<usize>()
                            + top_k * one
                    }
                };
                mixer + ffn
            })
            .sum();
        let linear = (0..c.n_layers).filter(|&i| !c.is_full_attention(i)).count();
        let pairs = (n * (n + 1) / 2) as f64;
        let attention = (c.n_layers - linear) as f64 * pairs * 4.0 * (c.q_heads * c.head_dim) as f64;
        let delta = linear as f64 * n as f64 * 6.0 * (c.lin_v_heads * c.lin_k_dim * c.lin_v_dim) as f64;
        2.0 * per_token as f64 * n as f64 + attention + delta + 2.0 * wts(self.head()).len() as f64
    }

    pub fn new_state(&self) -> Qwen35State {
        let c = &self.cfg;
        let conv_dim = 2 * c.lin_k_heads * c.lin_k_dim + c.lin_v_heads * c.lin_v_dim;
        let linear = (0..c.n_layers).filter(|&i| !c.is_full_attention(i)).count();
        Qwen35State {
            conv: vec![vec![0.0; conv_dim * (c.conv_kernel - 1)]; linear],
            recurrent: vec![vec![0.0; c.lin_v_heads * c.lin_v_dim * c.lin_k_dim]; linear],
            keys: vec![Vec::new(); c.n_layers - linear],
            values: vec![Vec::new(); c.n_layers - linear],
            position: 0,
        }
    }

    /// Runs `ids` after what `state` has seen and returns the logits of the last token.
    pub fn forward(&self, ids: &[u32], state: &mut Qwen35State) -> Result<Vec<f32>> {
        let mut out = self.forward_batch(&mut [(ids, state)])?;
        out.pop().ok_or_else(|| Error::Input("no sequence to run".into()))
    }

    /// Runs several sequences together, each its own tokens after what its own state has seen,
    /// and returns each one's last-token logits. The matrix products run over the rows of all
    /// sequences at once, so a decode step of B sequences reads the weights once instead of B
    /// times; the convolution, recurrence and attention run per sequence on its own state.
    pub fn forward_batch(&self, batch: &mut [(&[u32], &mut Qwen35State)]) -> Result<Vec<Vec<f32>>> {
        let c = &self.cfg;
        let h = c.hidden;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        for (ids, state) in batch.iter() {
            if ids.is_empty() {
                return Err(Error::Input("no tokens to run".into()));
            }
            if state.position + ids.len() > c.max_positions {
                return Err(Error::Input(format!(
                    "{} tokens exceed the model's context of {}",
                    state.position + ids.len(),
                    c.max_positions
                )));
            }
            if let Some(&id) = ids.iter().find(|&&id| id as usize >= c.vocab_size) {
                return Err(Error::Input(format!("token id {id} is outside the vocabulary of {}", c.vocab_size)));
            }
        }
        let lens: Vec<usize> = batch.iter().map(|(ids, _)| ids.len()).collect();
        let n: usize = lens.iter().sum();
        let segs = pack(lens.iter().copied());
        let table = wts(&self.embed);
        let mut x = vec![0.0f32; n * h];
        for (&id, row) in batch.iter().flat_map(|(ids, _)| ids.iter()).zip(x.chunks_mut(h)) {
            table.row_into(id as usize, h, row)?;
        }
        let positions: Vec<u32> =
            batch.iter().flat_map(|(ids, s)| (s.position..s.position + ids.len()).map(|p| p as u32)).collect();
        let mut a = vec![0.0f32; n * h];
        let (mut lin_i, mut full_i) = (0, 0);
        for layer in &self.layers {
            rms_norm(&x, h, Some(&layer.input_norm), 1.0, c.eps, &mut a)?;
            let mixed = match &layer.mixer {
                Mixer::Linear(m) => {
                    let (mut convs, mut recs): (Vec<&mut [f32]>, Vec<&mut [f32]>) = batch
                        .iter_mut()
                        .map(|(_, s)| {
                            let Qwen35State { conv, recurrent, .. } = &mut **s;
                            (conv[lin_i].as_mut_slice(), recurrent[lin_i].as_mut_slice())
                        })
                        .unzip();
                    lin_i += 1;
                    self.linear_attention(m, &a, &segs, &mut convs, &mut recs)?
                }
                Mixer::Full(m) => {
                    let out = self.full_attention(m, &a, &positions, &segs, batch, full_i)?;
                    full_i += 1;
                    out
                }
            };
            x.iter_mut().zip(&mixed).for_each(|(xv, &m)| *xv += m);
            rms_norm(&x, h, Some(&layer.post_norm), 1.0, c.eps, &mut a)?;
            let m = layer.ffn.forward(&a, n, h)?;
            x.iter_mut().zip(&m).for_each(|(xv, &mv)| *xv += mv);
        }
        let mut normed = vec![0.0f32; batch.len() * h];
        for ((seg, (ids, state)), out) in segs.iter().zip(batch.iter_mut()).zip(normed.chunks_mut(h)) {
            let last = seg.start + seg.len - 1;
            rms_norm(&x[last * h..(last + 1) * h], h, Some(&self.final_norm), 1.0, c.eps, out)?;
            state.position += ids.len();
        }
        let logits = linear_w(&normed, batch.len(), wts(self.head()), c.vocab_size, h)?;
        Ok(logits.chunks(c.vocab_size).map(|r| r.to_vec()).collect())
    }

    fn linear_attention(
        &self,
        m: &LinearAttention,
        a: &[f32],
        segs: &[Segment],
        conv_states: &mut [&mut [f32]],
        rec_states: &mut [&mut [f32]],
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let n: usize = segs.iter().map(|s| s.len).sum();
        let h = c.hidden;
        let (kd, vd, nv) = (c.lin_k_heads * c.lin_k_dim, c.lin_v_heads * c.lin_v_dim, c.lin_v_heads);
        let conv_dim = 2 * kd + vd;
        let mixed = linear_w(a, n, wts(&m.in_qkv), conv_dim, h)?;
        let z = linear_w(a, n, wts(&m.in_z), vd, h)?;
        let b = linear_w(a, n, wts(&m.in_b), nv, h)?;
        let alpha = linear_w(a, n, wts(&m.in_a), nv, h)?;
        let mut conv_out = vec![0.0f32; n * conv_dim];
        conv1d_silu_scan(&mixed, segs, &m.conv, c.conv_kernel, conv_states, &mut conv_out)?;
        let (mut q, mut k, mut v) = (Vec::with_capacity(n * kd), Vec::with_capacity(n * kd), Vec::with_capacity(n * vd));
        for row in conv_out.chunks(conv_dim) {
            q.extend_from_slice(&row[..kd]);
            k.extend_from_slice(&row[kd..2 * kd]);
            v.extend_from_slice(&row[2 * kd..]);
        }
        normalize_qk(&mut q, &mut k, c.lin_k_dim)?;
        let mut g = vec![0.0f32; n * nv];
        decay_gate(&alpha, &m.dt_bias, &m.a, &mut g)?;
        let mut beta = vec![0.0f32; n * nv];
        beta_gate(&b, &mut beta)?;
        let heads = DeltaRuleHeads {
            n_k_heads: c.lin_k_heads,
            n_v_heads: nv,
            d_k: c.lin_k_dim,
            d_v: c.lin_v_dim,
            key_head: c.key_head,
        };
        let inputs = DeltaRuleInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
        let mut core = vec![0.0f32; n * vd];
        // Prefill takes the chunked form (the reference's prefill path); short runs and decode
        // take the scan, which the chunked form equals to f32 rounding.
        if segs.iter().any(|s| s.len >= crate::kernels::gated_delta::DELTA_RULE_CHUNK) {
            delta_rule_chunked(&heads, inputs, segs, rec_states, &mut core)?;
        } else {
            delta_rule_scan(&heads, inputs, segs, rec_states, &mut core)?;
        }
        gated_rms_norm_inplace(&mut core, &z, &m.norm, c.eps)?;
        linear_w(&core, n, wts(&m.out), h, vd)
    }

    /// Gated attention of layer `full_i` (its index among the full-attention layers) for the
    /// packed rows of every sequence in `batch`, each attending to its own KV cache.
    fn full_attention(
        &self,
        m: &FullAttention,
        a: &[f32],
        positions: &[u32],
        segs: &[Segment],
        batch: &mut [(&[u32], &mut Qwen35State)],
        full_i: usize,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (n, h, hd) = (positions.len(), c.hidden, c.head_dim);
        let qg = linear_w(a, n, wts(&m.q_gate), c.q_heads * hd * 2, h)?;
        // q_proj rows are [query | gate] per head.
        let (mut q, mut gate) = (Vec::with_capacity(n * c.q_heads * hd), Vec::with_capacity(n * c.q_heads * hd));
        for head in qg.chunks(2 * hd) {
            q.extend_from_slice(&head[..hd]);
            gate.extend_from_slice(&head[hd..]);
        }
        let mut k = linear_w(a, n, wts(&m.k), c.kv_heads * hd, h)?;
        let v = linear_w(a, n, wts(&m.v), c.kv_heads * hd, h)?;
        let prep = HeadPrep { heads: c.q_heads, hd, norm: Some(Some(&m.q_norm)), eps: c.eps, rope: Some(&self.rope) };
        head_prep(&mut q, n, positions, &prep)?;
        head_prep(&mut k, n, positions, &HeadPrep { heads: c.kv_heads, norm: Some(Some(&m.k_norm)), ..prep })?;
        let shape = AttentionShape {
            q_heads: c.q_heads,
            kv_heads: c.kv_heads,
            hd,
            scale: (hd as f32).powf(-0.5),
            max_distance: None,
        };
        let (qw, kw) = (c.q_heads * hd, c.kv_heads * hd);
        let mut att = vec![0.0f32; n * qw];
        for (seg, (_, state)) in segs.iter().zip(batch.iter_mut()) {
            let rows = seg.start..seg.start + seg.len;
            let (keys, values) = (&mut state.keys[full_i], &mut state.values[full_i]);
            keys.extend_from_slice(&k[rows.start * kw..rows.end * kw]);
            values.extend_from_slice(&v[rows.start * kw..rows.end * kw]);
            let past = state.position;
            causal_attention(&q[rows.start * qw..rows.end * qw], seg.len, past, keys, values, &shape, &mut att[rows.start * qw..rows.end * qw])?;
        }
        for (o, &gv) in att.iter_mut().zip(&gate) {
            *o *= sigmoid(gv);
        }
        linear_w(&att, n, wts(&m.o), h, c.q_heads * hd)
    }
}
