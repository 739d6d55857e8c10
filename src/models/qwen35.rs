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
use crate::kernels::attention::AttentionShape;
use crate::kernels::backend::{CpuOps, GatedActivation, GatedDeltaInputs, HeadOps, Ops, ProjectedHeads};
use crate::kernels::cuda_ops::CudaOps;
use crate::models::Placement;
use crate::kernels::gated_delta::{DeltaRuleHeads, KeyHeadMap};
use crate::kernels::matmul::Weights;
use crate::kernels::pack;
use crate::kernels::rope::RopeTable;
use crate::kernels::sample::{LogitsWant, StepLogits};

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

    /// A weight matrix: bf16 tensors (both formats) and Q8_0 GGUF tensors stay as stored,
    /// everything else is f32.
    fn matrix(&self, prefix: &str, hf: &str, shape: &[usize]) -> Result<Matrix> {
        match self {
            Source::Hf(w) => w.load_matrix(&format!("{prefix}{hf}"), shape),
            Source::Gguf(f) => {
                let name = gguf_name(hf).ok_or_else(|| Error::tensor(hf, "has no GGUF counterpart"))?;
                f.load_matrix(&name, shape)
            }
        }
    }

    /// The experts of layer `layer`: one tensor per expert in HF checkpoints saved by
    /// transformers, stacked [experts][rows][cols] in GGUF (`ffn_{gate,up,down}_exps`).
    fn experts(&self, prefix: &str, layer: usize, ne: usize, ei: usize, h: usize) -> Result<Vec<[Matrix; 3]>> {
        match self {
            Source::Hf(w) => (0..ne)
                .map(|e| {
                    let name = |m: &str| format!("{prefix}layers.{layer}.mlp.experts.{e}.{m}.weight");
                    Ok([
                        w.load_matrix(&name("gate_proj"), &[ei, h])?,
                        w.load_matrix(&name("up_proj"), &[ei, h])?,
                        w.load_matrix(&name("down_proj"), &[h, ei])?,
                    ])
                })
                .collect(),
            Source::Gguf(f) => {
                let stacked = |m: &str, rows: usize, cols: usize| f.load_matrix_stack(&format!("blk.{layer}.{m}"), ne, [rows, cols]);
                let (g, u, d) = (stacked("ffn_gate_exps.weight", ei, h)?, stacked("ffn_up_exps.weight", ei, h)?, stacked("ffn_down_exps.weight", h, ei)?);
                Ok(g.into_iter().zip(u).zip(d).map(|((gate, up), down)| [gate, up, down]).collect())
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

/// Rows `rows` of a matrix as an f32 matrix (decoded from the stored dtype: exact).
fn select_rows(m: &Matrix, name: String, rows: impl Iterator<Item = usize>) -> Result<Matrix> {
    let cols = m.shape()[1];
    let w = Weights::from(m);
    let mut data = Vec::new();
    let mut n = 0;
    for r in rows {
        let at = data.len();
        data.resize(at + cols, 0.0);
        w.row_into(r, cols, &mut data[at..])?;
        n += 1;
    }
    Ok(Matrix::F32(Tensor::owned(name, vec![n, cols], data)))
}

/// Weights read per token, counted as stored in the file (what a backend keeping them so
/// reads), for the benchmark's roofline.
#[derive(Clone, Copy, Debug, Default)]
struct Footprint {
    /// Every layer matrix a token always reads (MoE: router and shared expert), elements and bytes.
    dense: (usize, usize),
    /// One expert of each MoE layer, summed over the layers.
    expert: (usize, usize),
    top_k: usize,
    /// All experts of all layers.
    all_experts: (usize, usize),
    head: (usize, usize),
    embed: (usize, usize),
}

impl Footprint {
    fn add(acc: &mut (usize, usize), m: &Matrix) {
        let w = Weights::from(m);
        acc.0 += w.len();
        acc.1 += w.bytes();
    }
}

struct LinearAttention<O: Ops> {
    in_qkv: O::Mat,
    in_z: O::Mat,
    in_b: O::Mat,
    in_a: O::Mat,
    conv: O::Vector,
    dt_bias: O::Vector,
    /// −exp(A_log), computed once.
    a: O::Vector,
    norm: O::Vector,
    out: O::Mat,
}

struct FullAttention<O: Ops> {
    /// `[q | gate | k | v]`: q_proj's rows regrouped at load (the checkpoint interleaves query
    /// and gate per head) and stacked with k and v, so one product yields all four and q, the
    /// gate, k and v are each a strided view of it.
    qgkv: O::Mat,
    o: O::Mat,
    q_norm: O::Vector,
    k_norm: O::Vector,
}

enum Mixer<O: Ops> {
    Linear(LinearAttention<O>),
    Full(FullAttention<O>),
}

struct Layer<O: Ops> {
    mixer: Mixer<O>,
    input_norm: O::Vector,
    post_norm: O::Vector,
    ffn: Ffn<O>,
}

/// A gated SiLU MLP, down(silu(gate·x) · up·x), gate and up stacked into one product.
struct Mlp<O: Ops> {
    gate_up: O::Mat,
    down: O::Mat,
    width: usize,
}

enum Ffn<O: Ops> {
    Dense(Mlp<O>),
    /// Router [experts][hidden] (softmax in f32 → top-k → renormalise) with the shared
    /// expert's sigmoid gate [1][hidden] stacked under it (one product), and the experts, the
    /// shared one among them ([`Ops::moe`]).
    Moe { router: O::Mat, experts: O::Experts, top_k: usize },
}

/// A layer's input: the residual stream `x` and its norm `a = rms(x)·norm`, which the layer
/// before left either formed (`pending` None) or, with `pending`, the previous FFN's gated
/// output and down projection whose residual step `x += act·downᵀ` and norm remain to run.
struct Residual<'r, O: Ops> {
    x: &'r mut O::Buf,
    a: &'r mut O::Buf,
    norm: &'r O::Vector,
    pending: Option<(O::Buf, &'r O::Mat)>,
}

/// Per-sequence state: conv and recurrent state of each linear layer, KV cache of each full
/// one, on the model's backend.
pub struct Qwen35State<O: Ops = CpuOps> {
    conv: Vec<O::Buf>,
    recurrent: Vec<O::Buf>,
    kv: Vec<O::Kv>,
    /// Tokens processed so far.
    pub position: usize,
}

pub struct Qwen35<O: Ops = CpuOps> {
    pub cfg: Qwen35Config,
    ops: O,
    embed: O::Table,
    head: O::Mat,
    layers: Vec<Layer<O>>,
    final_norm: O::Vector,
    rope: O::Rope,
    footprint: Footprint,
}

impl Qwen35<CpuOps> {
    /// Loads a Hugging Face checkpoint directory or a `.gguf` file for the CPU.
    pub fn load(path: &Path) -> Result<Qwen35<CpuOps>> {
        Self::load_on(path, CpuOps)
    }

    /// The model of an opened GGUF file (whose tokenizer the caller may read too).
    pub fn from_gguf(f: &GgufFile) -> Result<Qwen35<CpuOps>> {
        Self::from_gguf_on(f, CpuOps)
    }

    /// The model with every input embedding moved by one unit in the last place, up or down
    /// as `coin` says (the head, tied or not, is left as it was). Its logits differ from the
    /// model's by what the forward pass makes of one rounding of its input: the yardstick of a
    /// step's conditioning, against which another f32 implementation's difference is judged.
    #[cfg(test)]
    pub(crate) fn with_nudged_embeddings(mut self, mut coin: impl FnMut() -> bool) -> Result<Self> {
        let shape = self.embed.shape().to_vec();
        let width = shape.last().copied().unwrap_or(0);
        let mut table = Weights::from(&self.embed).to_f32(width)?;
        for e in table.iter_mut() {
            *e = if coin() { e.next_up() } else { e.next_down() };
        }
        self.embed = Matrix::F32(Tensor::owned(format!("{} (nudged)", self.embed.name()), shape, table));
        Ok(self)
    }
}

impl<O: Ops> Qwen35<O> {
    /// Loads a Hugging Face checkpoint directory or a `.gguf` file onto backend `ops`.
    pub fn load_on(path: &Path, ops: O) -> Result<Qwen35<O>> {
        // A missing path is named as given, not as the config.json a directory would hold.
        std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if path.is_file() {
            return Self::from_gguf_on(&GgufFile::open(path)?, ops);
        }
        Self::build(Qwen35Config::from_dir(path)?, Source::Hf(SafetensorsWeights::open_dir(path)?), ops)
    }

    pub fn from_gguf_on(f: &GgufFile, ops: O) -> Result<Qwen35<O>> {
        Self::build(Qwen35Config::from_gguf(f)?, Source::Gguf(f), ops)
    }

    pub fn ops(&self) -> &O {
        &self.ops
    }

    fn build(cfg: Qwen35Config, w: Source, ops: O) -> Result<Qwen35<O>> {
        let gguf = matches!(w, Source::Gguf(_));
        let p = cfg.prefix.clone();
        let h = cfg.hidden;
        // Counted as loaded, before a backend converts anything.
        let fp = std::cell::RefCell::new(Footprint::default());
        let raw = |name: &str, r: usize, c: usize| w.matrix(&p, name, &[r, c]);
        // (1 + w) norms: HF stores w, GGUF stores 1 + w already.
        let plus_one = |name: &str, d: usize| -> Result<O::Vector> {
            let t = w.get(&p, name, &[d])?;
            ops.vector(if gguf { t.data().to_vec() } else { t.data().iter().map(|&x| 1.0 + x).collect() })
        };
        let vec = |name: &str, d: usize| -> Result<Vec<f32>> { Ok(w.get(&p, name, &[d])?.data().to_vec()) };
        let (kd, vd) = (cfg.lin_k_heads * cfg.lin_k_dim, cfg.lin_v_heads * cfg.lin_v_dim);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let l = format!("layers.{i}.");
            let mat = |name: &str, r: usize, c: usize| -> Result<O::Mat> {
                let m = raw(name, r, c)?;
                Footprint::add(&mut fp.borrow_mut().dense, &m);
                ops.matrix(m)
            };
            let mixer = if cfg.is_full_attention(i) {
                let hd = cfg.head_dim;
                let qg = raw(&format!("{l}self_attn.q_proj.weight"), cfg.q_heads * hd * 2, h)?;
                let (k, v) = (raw(&format!("{l}self_attn.k_proj.weight"), cfg.kv_heads * hd, h)?, raw(&format!("{l}self_attn.v_proj.weight"), cfg.kv_heads * hd, h)?);
                for m in [&qg, &k, &v] {
                    Footprint::add(&mut fp.borrow_mut().dense, m);
                }
                let heads = 0..cfg.q_heads;
                let q = select_rows(&qg, format!("{l}q"), heads.clone().flat_map(|hh| hh * 2 * hd..hh * 2 * hd + hd))?;
                let gate = select_rows(&qg, format!("{l}gate"), heads.flat_map(|hh| hh * 2 * hd + hd..(hh + 1) * 2 * hd))?;
                Mixer::Full(FullAttention {
                    qgkv: ops.stacked(format!("{l}self_attn.qgkv"), vec![q, gate, k, v])?,
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
                    conv: ops.vector(conv)?,
                    dt_bias: ops.vector(vec(&format!("{l}linear_attn.dt_bias"), cfg.lin_v_heads)?)?,
                    // GGUF's ssm_a is −exp(A_log) already.
                    a: ops.vector(if gguf { a_log } else { a_log.iter().map(|&x| -x.exp()).collect() })?,
                    norm: ops.vector(vec(&format!("{l}linear_attn.norm.weight"), cfg.lin_v_dim)?)?,
                    out: mat(&format!("{l}linear_attn.out_proj.weight"), h, vd)?,
                })
            };
            // A gated MLP's gate, up and down matrices, which every token reads.
            let mlp = |prefix: &str, width: usize| -> Result<[Matrix; 3]> {
                let (g, u, d) = (raw(&format!("{prefix}gate_proj.weight"), width, h)?, raw(&format!("{prefix}up_proj.weight"), width, h)?, raw(&format!("{prefix}down_proj.weight"), h, width)?);
                for m in [&g, &u, &d] {
                    Footprint::add(&mut fp.borrow_mut().dense, m);
                }
                Ok([g, u, d])
            };
            let ffn = match &cfg.moe {
                None => {
                    let [g, u, d] = mlp(&format!("{l}mlp."), cfg.intermediate)?;
                    Ffn::Dense(Mlp { gate_up: ops.stacked(format!("{l}mlp.gate_up"), vec![g, u])?, down: ops.matrix(d)?, width: cfg.intermediate })
                }
                Some(moe) => {
                    let (ne, ei, si) = (moe.experts, moe.expert_intermediate, moe.shared_intermediate);
                    let shared = mlp(&format!("{l}mlp.shared_expert."), si)?;
                    let experts = w.experts(&p, i, ne, ei, h)?;
                    for (e, ms) in experts.iter().enumerate() {
                        for m in ms {
                            Footprint::add(&mut fp.borrow_mut().all_experts, m);
                            if e == 0 {
                                Footprint::add(&mut fp.borrow_mut().expert, m);
                            }
                        }
                    }
                    fp.borrow_mut().top_k = moe.top_k;
                    let router = raw(&format!("{l}mlp.gate.weight"), ne, h)?;
                    let shared_gate = raw(&format!("{l}mlp.shared_expert_gate.weight"), 1, h)?;
                    for m in [&router, &shared_gate] {
                        Footprint::add(&mut fp.borrow_mut().dense, m);
                    }
                    Ffn::Moe {
                        router: ops.stacked(format!("{l}mlp.gate+shared_expert_gate"), vec![router, shared_gate])?,
                        experts: ops.experts(experts, Some(shared))?,
                        top_k: moe.top_k,
                    }
                }
            };
            layers.push(Layer {
                mixer,
                input_norm: plus_one(&format!("{l}input_layernorm.weight"), h)?,
                post_norm: plus_one(&format!("{l}post_attention_layernorm.weight"), h)?,
                ffn,
            });
        }
        let embed = raw("embed_tokens.weight", cfg.vocab_size, h)?;
        Footprint::add(&mut fp.borrow_mut().embed, &embed);
        let head = if cfg.tie_embeddings && !w.has_lm_head() {
            embed.clone()
        } else {
            // The head sits outside the model prefix in HF checkpoints.
            w.matrix("", "lm_head.weight", &[cfg.vocab_size, h])?
        };
        Footprint::add(&mut fp.borrow_mut().head, &head);
        Ok(Qwen35 {
            rope: ops.rope(RopeTable::new(cfg.rope_theta, cfg.rotary_dim, cfg.max_positions))?,
            final_norm: plus_one("norm.weight", h)?,
            head: ops.matrix(head)?,
            embed: ops.table(embed)?,
            layers,
            footprint: fp.into_inner(),
            cfg,
            ops,
        })
    }

    /// Bytes of all weight matrices as stored (bf16 counts 2 per value, Q8_0 its blocks),
    /// embedding and head included once each (a tied head counts once).
    pub fn weight_bytes(&self) -> usize {
        let f = &self.footprint;
        let head = if self.cfg.tie_embeddings { 0 } else { f.head.1 };
        f.dense.1 + f.all_experts.1 + f.embed.1 + head
    }

    /// The fewest bytes one decode step at context `ctx` must read: every layer matrix (MoE:
    /// top-k experts), the head, one embedding row, the recurrent and conv state (read and
    /// written back) and the KV cache.
    pub fn decode_bytes_per_token(&self, ctx: usize) -> usize {
        let (c, f) = (&self.cfg, &self.footprint);
        let mut b = f.dense.1 + f.top_k * f.expert.1 + f.head.1 + 4 * c.hidden;
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
        let (c, f) = (&self.cfg, &self.footprint);
        let per_token = f.dense.0 + f.top_k * f.expert.0;
        let linear = (0..c.n_layers).filter(|&i| !c.is_full_attention(i)).count();
        let pairs = (n * (n + 1) / 2) as f64;
        let attention = (c.n_layers - linear) as f64 * pairs * 4.0 * (c.q_heads * c.head_dim) as f64;
        let delta = linear as f64 * n as f64 * 6.0 * (c.lin_v_heads * c.lin_k_dim * c.lin_v_dim) as f64;
        2.0 * per_token as f64 * n as f64 + attention + delta + 2.0 * f.head.0 as f64
    }

    pub fn new_state(&self) -> Result<Qwen35State<O>> {
        let c = &self.cfg;
        let conv_dim = 2 * c.lin_k_heads * c.lin_k_dim + c.lin_v_heads * c.lin_v_dim;
        let linear = (0..c.n_layers).filter(|&i| !c.is_full_attention(i)).count();
        let ops = &self.ops;
        Ok(Qwen35State {
            conv: (0..linear).map(|_| ops.zeros(conv_dim * (c.conv_kernel - 1))).collect::<Result<_>>()?,
            recurrent: (0..linear).map(|_| ops.zeros(c.lin_v_heads * c.lin_v_dim * c.lin_k_dim)).collect::<Result<_>>()?,
            kv: (linear..c.n_layers).map(|_| ops.kv_cache(c.kv_heads * c.head_dim)).collect::<Result<_>>()?,
            position: 0,
        })
    }

    /// Runs `ids` after what `state` has seen and returns the logits of the last token.
    pub fn forward(&self, ids: &[u32], state: &mut Qwen35State<O>) -> Result<Vec<f32>> {
        let mut out = self.forward_batch(&mut [(ids, state)])?;
        out.pop().ok_or_else(|| Error::Input("no sequence to run".into()))
    }

    /// Runs several sequences together, each its own tokens after what its own state has seen,
    /// and returns each one's last-token logits. The matrix products run over the rows of all
    /// sequences at once, so a decode step of B sequences reads the weights once instead of B
    /// times; the convolution, recurrence and attention run per sequence on its own state.
    pub fn forward_batch(&self, batch: &mut [(&[u32], &mut Qwen35State<O>)]) -> Result<Vec<Vec<f32>>> {
        let wants = vec![LogitsWant::Full; batch.len()];
        self.forward_batch_wants(batch, &wants)?.into_iter().map(StepLogits::into_full).collect()
    }

    /// [`Qwen35::forward_batch`], returning of each sequence's logits what `wants` asks: the
    /// whole row, or only its best entries (what a greedy or top-k sampler reads), which a GPU
    /// picks without copying the row.
    pub fn forward_batch_wants(&self, batch: &mut [(&[u32], &mut Qwen35State<O>)], wants: &[LogitsWant]) -> Result<Vec<StepLogits>> {
        let (c, ops) = (&self.cfg, &self.ops);
        if wants.len() != batch.len() {
            return Err(Error::Input(format!("{} logits requests for {} sequences", wants.len(), batch.len())));
        }
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
        let segs = pack(batch.iter().map(|(ids, _)| ids.len()));
        let n: usize = segs.iter().map(|s| s.len).sum();
        let ids: Vec<u32> = batch.iter().flat_map(|(ids, _)| ids.iter().copied()).collect();
        let past: Vec<usize> = batch.iter().map(|(_, s)| s.position).collect();
        let _one_at_a_time = ops.serialize();
        // Caches grow before the step, so that a recorded step allocates nothing that outlives it.
        for (ids, state) in batch.iter_mut() {
            let (filled, need) = (state.position, state.position + ids.len());
            for kv in &mut state.kv {
                ops.kv_reserve(kv, filled, need)?;
            }
        }
        // A decode step (one token per sequence) may be recorded and replayed: its work depends
        // on the number of sequences and on their state and cache buffers, which the key names.
        // (A backend whose MoE routing reads back to the host for this many rows cannot record
        // the step and runs it plainly.)
        let decode = segs.iter().all(|s| s.len == 1);
        let key: Option<Vec<u64>> = decode.then(|| {
            let mut key = vec![batch.len() as u64];
            for (_, s) in batch.iter() {
                key.extend(s.conv.iter().chain(&s.recurrent).map(|b| ops.buf_handle(b)));
                key.extend(s.kv.iter().flat_map(|kv| ops.kv_handle(kv)));
            }
            key
        });
        let logits = ops.run_step(&segs, &ids, &past, key.as_deref(), &mut |b| self.step(b, n, batch), &|y| {
            ops.select_logits(y, c.vocab_size, wants)
        })?;
        for (ids, state) in batch.iter_mut() {
            state.position += ids.len();
        }
        Ok(logits)
    }

    /// The forward pass of one step over the packed batch `b` of `n` rows: each sequence's
    /// last-token logits, [sequences][vocab], on the backend.
    fn step(&self, b: &O::Batch, n: usize, batch: &mut [(&[u32], &mut Qwen35State<O>)]) -> Result<O::Buf> {
        let (c, ops) = (&self.cfg, &self.ops);
        let h = c.hidden;
        let mut x = ops.embed(&self.embed, b, 1.0)?;
        let first_norm = self.layers.first().map_or(&self.final_norm, |l| &l.input_norm);
        let mut a = ops.rms_norm(&x, h, Some(first_norm), 1.0, c.eps)?;
        let (mut lin_i, mut full_i) = (0, 0);
        // A dense FFN's gated output and its down projection, left to the layer after it: that
        // layer's input products run with the residual step and its norm.
        let mut pending: Option<(O::Buf, &O::Mat)> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut residual = Residual { x: &mut x, a: &mut a, norm: &layer.input_norm, pending: pending.take() };
            // The mixer's output before its projection, and that projection.
            let (mixed, out) = match &layer.mixer {
                Mixer::Linear(m) => {
                    let (mut convs, mut recs): (Vec<&mut O::Buf>, Vec<&mut O::Buf>) = batch
                        .iter_mut()
                        .map(|(_, s)| {
                            let Qwen35State { conv, recurrent, .. } = &mut **s;
                            (&mut conv[lin_i], &mut recurrent[lin_i])
                        })
                        .unzip();
                    lin_i += 1;
                    (self.linear_attention(m, &mut residual, n, b, &mut convs, &mut recs)?, &m.out)
                }
                Mixer::Full(m) => {
                    let mut caches: Vec<&mut O::Kv> = batch.iter_mut().map(|(_, s)| &mut s.kv[full_i]).collect();
                    full_i += 1;
                    (self.full_attention(m, &mut residual, n, b, &mut caches)?, &m.o)
                }
            };
            // The next layer's pre-norm, or after the last layer the final norm; a next layer
            // takes the FFN's down projection with its input products.
            let next = self.layers.get(i + 1).map_or(&self.final_norm, |l| &l.input_norm);
            pending = self.residual_ffn(layer, (&mixed, out), &mut a, n, &mut x, next, i + 1 < self.layers.len())?;
        }
        // (The last layer leaves nothing pending: no layer follows it.)
        // A decode step's rows are already each sequence's last (one row a sequence): no copy.
        if ops.segments(b).iter().all(|s| s.len == 1) {
            return ops.linear(&a, batch.len(), &self.head, None);
        }
        let last = ops.last_rows(&a, h, b)?;
        ops.linear(&last, batch.len(), &self.head, None)
    }

    /// A layer's mixer output projection and the residual step after it, `x += out(mixed)`
    /// and `a = rms(x)·post_norm`, then its FFN and the residual step after that: `x +=
    /// ffn(a)`, then `a = rms(x)·next`. The dense FFN's gated product forms its input's norm
    /// itself (fused for a decode step); its down projection ends in the next norm, or where
    /// `leave_down` (the next layer's input products take it) is returned with its input.
    #[allow(clippy::too_many_arguments)]
    fn residual_ffn<'m>(
        &'m self,
        layer: &'m Layer<O>,
        (mixed, out): (&O::Buf, &O::Mat),
        a: &mut O::Buf,
        n: usize,
        x: &mut O::Buf,
        next: &O::Vector,
        leave_down: bool,
    ) -> Result<Option<(O::Buf, &'m O::Mat)>> {
        let (c, ops) = (&self.cfg, &self.ops);
        let h = c.hidden;
        match &layer.ffn {
            Ffn::Dense(m) => {
                let act = ops.linear_residual_norm_glu(mixed, n, out, x, &layer.post_norm, h, c.eps, a, &m.gate_up, m.width, GatedActivation::Silu)?;
                if leave_down {
                    return Ok(Some((act, &m.down)));
                }
                ops.linear_residual_norm(&act, n, &m.down, x, next, h, c.eps, a)?;
            }
            Ffn::Moe { router, experts, top_k } => {
                ops.linear_residual_norm(mixed, n, out, x, &layer.post_norm, h, c.eps, a)?;
                let logits = ops.linear(a, n, router, None)?;
                ops.moe_residual_norm(a, h, &logits, experts, *top_k, x, next, c.eps)?;
            }
        }
        Ok(None)
    }

    /// The gated delta rule of the packed rows, each sequence on its own conv and recurrent
    /// state: the normed output before the layer's out projection (which `step` fuses with
    /// the residual step). Its input products run the residual step the layer before left
    /// pending, if any.
    fn linear_attention(
        &self,
        m: &LinearAttention<O>,
        input: &mut Residual<'_, O>,
        n: usize,
        b: &O::Batch,
        conv_states: &mut [&mut O::Buf],
        rec_states: &mut [&mut O::Buf],
    ) -> Result<O::Buf> {
        let (c, ops) = (&self.cfg, &self.ops);
        let (kd, vd) = (c.lin_k_heads * c.lin_k_dim, c.lin_v_heads * c.lin_v_dim);
        let conv_dim = 2 * kd + vd;
        let (ws, conv) = ([&m.in_qkv, &m.in_z, &m.in_b, &m.in_a], (&m.conv, c.conv_kernel));
        let projections = match input.pending.take() {
            Some((act, down)) => ops.linear_residual_norm_linears_conv((&act, n, down), input.x, input.norm, c.hidden, c.eps, input.a, &ws, conv, conv_dim, b, conv_states)?,
            None => ops.linears_conv(input.a, n, &ws, conv, conv_dim, b, conv_states)?,
        };
        let [qkv, z, beta_in, alpha]: [O::Buf; 4] = projections
            .try_into()
            .map_err(|_| Error::Shape("linear attention: four input projections expected".into()))?;
        let heads = DeltaRuleHeads {
            n_k_heads: c.lin_k_heads,
            n_v_heads: c.lin_v_heads,
            d_k: c.lin_k_dim,
            d_v: c.lin_v_dim,
            key_head: c.key_head,
        };
        let x = GatedDeltaInputs { qkv: &qkv, z: &z, alpha: &alpha, b: &beta_in, dt_bias: &m.dt_bias, a: &m.a, norm: &m.norm, eps: c.eps };
        ops.gated_delta(x, &heads, b, rec_states)
    }

    /// Gated attention for the packed rows of every sequence, each attending to its own cache:
    /// the output before the o projection (which `step` fuses with the residual step). Its
    /// input product runs the residual step the layer before left pending, if any.
    fn full_attention(&self, m: &FullAttention<O>, input: &mut Residual<'_, O>, n: usize, b: &O::Batch, caches: &mut [&mut O::Kv]) -> Result<O::Buf> {
        let (c, ops) = (&self.cfg, &self.ops);
        let hd = c.head_dim;
        let (qw, kw) = (c.q_heads * hd, c.kv_heads * hd);
        let stride = 2 * qw + 2 * kw;
        let mut y = match input.pending.take() {
            Some((act, down)) => ops.linear_residual_norm_linear((&act, n, down), input.x, input.norm, c.hidden, c.eps, input.a, &m.qgkv)?,
            None => ops.linear(input.a, n, &m.qgkv, None)?,
        };
        let q_prep = HeadOps::<O> { heads: c.q_heads, hd, norm: Some(Some(&m.q_norm)), eps: c.eps, rope: Some(&self.rope) };
        let k_prep = HeadOps { heads: c.kv_heads, norm: Some(Some(&m.k_norm)), ..q_prep };
        // The rows are q | gate | k | v.
        let heads = ProjectedHeads { stride, q: 0, gate: qw, k: 2 * qw, v: 2 * qw + kw, q_prep, k_prep };
        let shape = AttentionShape { q_heads: c.q_heads, kv_heads: c.kv_heads, hd, scale: (hd as f32).powf(-0.5), max_distance: None };
        ops.projected_kv_attention(&mut y, heads, b, caches, &shape)
    }
}

/// Evaluates `$body` with `$m` bound to the model of a [`PlacedQwen35`], whichever backend
/// holds it (the same code, compiled once per backend).
macro_rules! on_model {
    ($placed:expr, $m:ident => $body:expr) => {
        match $placed {
            PlacedQwen35::Cpu($m) => $body,
            PlacedQwen35::Cuda($m) => $body,
        }
    };
}

/// A Qwen3.5 model on the CPU or a GPU, with the interface the generation loop uses.
pub enum PlacedQwen35 {
    Cpu(Qwen35<CpuOps>),
    Cuda(Qwen35<CudaOps>),
}

/// A sequence's state on the backend of the model that made it.
pub enum PlacedState {
    Cpu(Qwen35State<CpuOps>),
    Cuda(Qwen35State<CudaOps>),
}

impl PlacedState {
    /// Tokens processed so far.
    pub fn position(&self) -> usize {
        match self {
            PlacedState::Cpu(s) => s.position,
            PlacedState::Cuda(s) => s.position,
        }
    }
}

fn foreign_state() -> Error {
    Error::Input("a sequence state made by a model on another device".into())
}

impl PlacedQwen35 {
    /// Loads a checkpoint directory or a GGUF file onto `placement`.
    pub fn load(path: &Path, placement: &Placement) -> Result<PlacedQwen35> {
        Ok(match placement {
            Placement::Cpu => PlacedQwen35::Cpu(Qwen35::load(path)?),
            Placement::Cuda(gpu, precision) => PlacedQwen35::Cuda(Qwen35::load_on(path, CudaOps::new(gpu.clone(), *precision)?)?),
        })
    }

    /// The model of an opened GGUF file, on `placement`.
    pub fn from_gguf(f: &GgufFile, placement: &Placement) -> Result<PlacedQwen35> {
        Ok(match placement {
            Placement::Cpu => PlacedQwen35::Cpu(Qwen35::from_gguf(f)?),
            Placement::Cuda(gpu, precision) => PlacedQwen35::Cuda(Qwen35::from_gguf_on(f, CudaOps::new(gpu.clone(), *precision)?)?),
        })
    }

    pub fn cfg(&self) -> &Qwen35Config {
        on_model!(self, m => &m.cfg)
    }

    /// `cpu`, or the GPU and precision.
    pub fn device(&self) -> String {
        match self {
            PlacedQwen35::Cpu(_) => "cpu".into(),
            PlacedQwen35::Cuda(m) => m.ops().describe(),
        }
    }

    pub fn weight_bytes(&self) -> usize {
        on_model!(self, m => m.weight_bytes())
    }

    pub fn decode_bytes_per_token(&self, ctx: usize) -> usize {
        on_model!(self, m => m.decode_bytes_per_token(ctx))
    }

    pub fn prefill_flops(&self, n: usize) -> f64 {
        on_model!(self, m => m.prefill_flops(n))
    }

    pub fn new_state(&self) -> Result<PlacedState> {
        Ok(match self {
            PlacedQwen35::Cpu(m) => PlacedState::Cpu(m.new_state()?),
            PlacedQwen35::Cuda(m) => PlacedState::Cuda(m.new_state()?),
        })
    }

    pub fn forward(&self, ids: &[u32], state: &mut PlacedState) -> Result<Vec<f32>> {
        self.forward_want(ids, state, LogitsWant::Full)?.into_full()
    }

    /// [`PlacedQwen35::forward`], returning of the last token's logits what `want` asks.
    pub fn forward_want(&self, ids: &[u32], state: &mut PlacedState, want: LogitsWant) -> Result<StepLogits> {
        let mut out = self.forward_batch_wants(&mut [(ids, state)], &[want])?;
        out.pop().ok_or_else(|| Error::Input("no sequence to run".into()))
    }

    pub fn forward_batch(&self, batch: &mut [(&[u32], &mut PlacedState)]) -> Result<Vec<Vec<f32>>> {
        let wants = vec![LogitsWant::Full; batch.len()];
        self.forward_batch_wants(batch, &wants)?.into_iter().map(StepLogits::into_full).collect()
    }

    /// [`Qwen35::forward_batch_wants`] on whichever backend holds the model.
    pub fn forward_batch_wants(&self, batch: &mut [(&[u32], &mut PlacedState)], wants: &[LogitsWant]) -> Result<Vec<StepLogits>> {
        match self {
            PlacedQwen35::Cpu(m) => {
                let mut own = batch
                    .iter_mut()
                    .map(|(ids, s)| match s {
                        PlacedState::Cpu(s) => Ok((*ids, s)),
                        _ => Err(foreign_state()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                m.forward_batch_wants(&mut own, wants)
            }
            PlacedQwen35::Cuda(m) => {
                let mut own = batch
                    .iter_mut()
                    .map(|(ids, s)| match s {
                        PlacedState::Cuda(s) => Ok((*ids, s)),
                        _ => Err(foreign_state()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                m.forward_batch_wants(&mut own, wants)
            }
        }
    }
}
