//! The EmbeddingGemma text encoders, written once over the op set:
//!
//! - EmbeddingGemma 300M: `gemma3_text` with `use_bidirectional_attention`. Norms are `(1 + w)`,
//!   attention is scaled by `query_pre_attn_scalar^-½`, no v norm, and the sliding window is
//!   symmetric with radius derived from the config's W (see `window_max_distance`).
//! - EmbeddingGemma 2: `embedding_gemma2_text` (or the `embedding_gemma2` composite, whose text
//!   part lives under `language_model.`). Norms multiply by `w`, attention scaling is 1, v is
//!   RMS-normed without a weight, global layers have their own head size and kv-head count,
//!   the window is `|i−j| ≤ W`, a per-layer-embedding (PLE) block follows each MLP,
//!   `h *= layer_scalar` ends each layer, and the pooled state is projected to `embedding_dim`.
//!
//! Both: embeddings × √hidden (rounded to f32, as the reference computes in f32), RoPE with one
//! θ per layer type over the whole head, gelu_tanh MLP, a final RMS-norm, mean pooling.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::formats::config::JsonFile;
use crate::formats::safetensors::SafetensorsWeights;
use crate::formats::Tensor;
use crate::kernels::attention::AttentionShape;
use crate::kernels::backend::{CpuOps, GatedActivation, HeadOps, Ops, SandwichNorm, View};
use crate::kernels::embedding::check_ids;
use crate::kernels::rope::RopeTable;
use crate::kernels::Segment;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// EmbeddingGemma 300M (`gemma3_text`, bidirectional).
    V1,
    /// EmbeddingGemma 2 text encoder.
    V2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    Sliding,
    Full,
}

#[derive(Clone, Debug)]
pub struct LayerConfig {
    pub kind: LayerKind,
    pub head_dim: usize,
    pub kv_heads: usize,
}

#[derive(Clone, Debug)]
pub struct EncoderConfig {
    pub variant: Variant,
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub q_heads: usize,
    pub layers: Vec<LayerConfig>,
    pub eps: f32,
    pub sliding_window: usize,
    pub rope_theta_full: f64,
    pub rope_theta_sliding: f64,
    pub max_positions: usize,
    pub attention_scale: f32,
    /// V2: width of the per-layer embedding signal.
    pub ple_dim: usize,
    /// V2: output width of `embedding_projection`; V1: the hidden size.
    pub out_dim: usize,
    pub pad_id: u32,
    /// Multimodal placeholder ids that the composite model maps to the pad id before lookup.
    pub placeholder_ids: Vec<u32>,
    /// Prefix of every weight name (`language_model.` in the composite checkpoint).
    pub prefix: String,
}

fn rope_theta(cfg: &JsonFile, layer_type: &str, legacy_key: &str, default: f64) -> Result<f64> {
    if let Some(rp) = cfg.sub("rope_parameters") {
        if let Some(p) = rp.sub(layer_type) {
            let kind = p.opt_str("rope_type")?.unwrap_or("default");
            if kind != "default" {
                return Err(Error::unsupported(&cfg.path, format!("rope_type `{kind}` for {layer_type} layers")));
            }
            return p.f64("rope_theta");
        }
        if rp.get("rope_theta").is_some() && layer_type == "full_attention" {
            return rp.f64("rope_theta");
        }
    }
    cfg.require_absent_or("rope_scaling", &Value::Null, "only unscaled RoPE is supported")?;
    Ok(cfg.opt_f64(legacy_key)?.unwrap_or(default))
}

impl EncoderConfig {
    /// Reads `config.json`, naming the key of anything we do not support.
    pub fn from_dir(dir: &Path) -> Result<EncoderConfig> {
        let top = JsonFile::read(&dir.join("config.json"))?;
        let model_type = top.str("model_type")?.to_string();
        let (cfg, variant, prefix, placeholder_ids) = match model_type.as_str() {
            "gemma3_text" => {
                if top.opt_bool("use_bidirectional_attention")? != Some(true) {
                    return Err(Error::unsupported(
                        &top.path,
                        "gemma3_text without `use_bidirectional_attention: true` is a causal LM, not EmbeddingGemma",
                    ));
                }
                (top, Variant::V1, String::new(), vec![])
            }
            "embedding_gemma2_text" => (top, Variant::V2, String::new(), vec![]),
            "embedding_gemma2" => {
                let text = top.sub("text_config").ok_or_else(|| Error::format(&top.path, "missing `text_config`"))?;
                let ids = ["image_token_id", "video_token_id", "audio_token_id"]
                    .iter()
                    .filter_map(|k| top.opt_usize(k).transpose())
                    .map(|r| r.map(|v| v as u32))
                    .collect::<Result<Vec<_>>>()?;
                (text, Variant::V2, "language_model.".to_string(), ids)
            }
            other => {
                return Err(Error::unsupported(
                    &top.path,
                    format!("model_type `{other}` (embedding models: gemma3_text, embedding_gemma2, embedding_gemma2_text)"),
                ))
            }
        };
        let act = cfg.opt_str("hidden_activation")?.or(cfg.opt_str("hidden_act")?).unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(Error::unsupported(&cfg.path, format!("hidden_activation `{act}` (gelu_pytorch_tanh is)")));
        }
        cfg.require_absent_or("attention_bias", &Value::Bool(false), "projections have no bias")?;
        let hidden = cfg.usize("hidden_size")?;
        let q_heads = cfg.usize("num_attention_heads")?;
        let n_layers = cfg.usize("num_hidden_layers")?;
        let kv_heads = cfg.usize("num_key_value_heads")?;
        let head_dim = cfg.opt_usize("head_dim")?.unwrap_or(hidden / q_heads.max(1));
        let layer_types = match cfg.opt_str_list("layer_types")? {
            Some(t) => t,
            None => {
                let pattern = cfg.opt_usize("sliding_window_pattern")?.or(cfg.opt_usize("_sliding_window_pattern")?).unwrap_or(6);
                (0..n_layers)
                    .map(|i| if (i + 1) % pattern.max(1) == 0 { "full_attention" } else { "sliding_attention" }.to_string())
                    .collect()
            }
        };
        if layer_types.len() != n_layers {
            return Err(Error::format(
                &cfg.path,
                format!("`layer_types` has {} entries for {n_layers} layers", layer_types.len()),
            ));
        }
        let per_layer = cfg.sub("per_layer_config");
        let mut layers = Vec::with_capacity(n_layers);
        for (i, t) in layer_types.iter().enumerate() {
            let kind = match t.as_str() {
                "sliding_attention" => LayerKind::Sliding,
                "full_attention" => LayerKind::Full,
                other => return Err(Error::unsupported(&cfg.path, format!("layer type `{other}` of layer {i}"))),
            };
            let (mut hd, mut kvh) = (head_dim, kv_heads);
            if variant == Variant::V2 && kind == LayerKind::Full {
                // Global layers carry their own head size and kv-head count (512 and 1 in the
                // released model); the saved config lists them per layer index.
                hd = cfg.opt_usize("global_head_dim")?.unwrap_or(512);
                kvh = cfg.opt_usize("num_global_key_value_heads")?.unwrap_or(1);
                if let Some(l) = per_layer.as_ref().and_then(|p| p.sub(&i.to_string())) {
                    hd = l.opt_usize("head_dim")?.unwrap_or(hd);
                    kvh = l.opt_usize("num_key_value_heads")?.unwrap_or(kvh);
                }
            }
            if kvh == 0 || q_heads % kvh != 0 || hd % 2 != 0 {
                return Err(Error::unsupported(
                    &cfg.path,
                    format!("layer {i}: {q_heads} query heads over {kvh} kv heads of size {hd}"),
                ));
            }
            layers.push(LayerConfig { kind, head_dim: hd, kv_heads: kvh });
        }
        let attention_scale = match variant {
            Variant::V1 => {
                cfg.require_absent_or("attn_logit_softcapping", &Value::Null, "no attention softcap is supported")?;
                (cfg.f64("query_pre_attn_scalar")? as f32).powf(-0.5)
            }
            Variant::V2 => 1.0,
        };
        let (ple_dim, out_dim) = match variant {
            Variant::V1 => (0, hidden),
            Variant::V2 => (cfg.opt_usize("hidden_size_per_layer_input")?.unwrap_or(512), cfg.opt_usize("embedding_dim")?.unwrap_or(768)),
        };
        Ok(EncoderConfig {
            variant,
            vocab_size: cfg.usize("vocab_size")?,
            hidden,
            intermediate: cfg.usize("intermediate_size")?,
            q_heads,
            layers,
            eps: cfg.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            sliding_window: cfg.opt_usize("sliding_window")?.unwrap_or(512),
            rope_theta_full: rope_theta(&cfg, "full_attention", "rope_theta", 1e6)?,
            rope_theta_sliding: rope_theta(&cfg, "sliding_attention", "rope_local_base_freq", 1e4)?,
            max_positions: cfg.opt_usize("max_position_embeddings")?.unwrap_or(2048),
            attention_scale,
            ple_dim,
            out_dim,
            pad_id: cfg.opt_usize("pad_token_id")?.unwrap_or(0) as u32,
            placeholder_ids,
            prefix,
        })
    }

    /// The largest |i − j| a sliding layer lets a query see.
    ///
    /// V1: the config's `sliding_window` W is the width of the causal Gemma 3 window; the
    /// reference's bidirectional form turns it into the exclusive radius `W/2 + 1`
    /// (Gemma3TextConfig.__post_init__), so a query sees `|i − j| < W/2 + 1`, i.e. ≤ W/2:
    /// 256 positions either side for the released W = 512.
    pub fn window_max_distance(&self) -> usize {
        match self.variant {
            Variant::V1 => self.sliding_window / 2,
            Variant::V2 => self.sliding_window,
        }
    }
}

struct PleBlock<O: Ops> {
    gate: O::Mat,
    proj: O::Mat,
    post_norm: O::Vector,
}

struct Layer<O: Ops> {
    cfg: LayerConfig,
    /// q, k and v projections stacked: one GEMM writes [t][q | k | v].
    wqkv: O::Mat,
    wo: O::Mat,
    q_norm: O::Vector,
    k_norm: O::Vector,
    input_norm: O::Vector,
    post_attn_norm: O::Vector,
    pre_ff_norm: O::Vector,
    post_ff_norm: O::Vector,
    /// gate and up stacked: one GEMM writes [t][gate | up].
    gate_up: O::Mat,
    down: O::Mat,
    ple: Option<PleBlock<O>>,
    layer_scalar: f32,
}

/// A loaded encoder on backend `O`: token ids in, pooled sequence vectors out.
pub struct Encoder<O: Ops = CpuOps> {
    pub cfg: EncoderConfig,
    ops: O,
    embed: O::Table,
    embed_scale: f32,
    layers: Vec<Layer<O>>,
    final_norm: O::Vector,
    /// V2: per-layer-input projection [L·P][hidden] and its norm weight [P].
    ple_projection: Option<(O::Mat, O::Vector)>,
    /// V2: `embedding_projection` [out_dim][hidden].
    out_projection: Option<O::Mat>,
    rope_full: O::Rope,
    rope_sliding: O::Rope,
    positions: usize,
    embed_params: usize,
    matmul_params: usize,
}

impl Encoder<CpuOps> {
    /// Loads the weights of `dir` for the CPU, checking every shape against the config.
    /// Positions up to `max_positions` get RoPE tables.
    pub fn load(dir: &Path, max_positions: usize) -> Result<Encoder<CpuOps>> {
        Encoder::load_on(dir, max_positions, CpuOps)
    }
}

impl<O: Ops> Encoder<O> {
    /// Loads the weights of `dir` onto backend `ops` (uploaded and converted once).
    pub fn load_on(dir: &Path, max_positions: usize, ops: O) -> Result<Encoder<O>> {
        let cfg = EncoderConfig::from_dir(dir)?;
        let w = SafetensorsWeights::open_dir(dir)?;
        let p = &cfg.prefix;
        let h = cfg.hidden;
        // V1 stores w for a (1 + w) norm: add the one here, the same f32 addition as the
        // reference's forward. V2 multiplies by w directly.
        let norm = |name: &str, d: usize| -> Result<O::Vector> {
            let t = w.get(&format!("{p}{name}"), &[d])?;
            ops.vector(match cfg.variant {
                Variant::V1 => t.data().iter().map(|&x| 1.0 + x).collect(),
                Variant::V2 => t.data().to_vec(),
            })
        };
        let tensor = |name: &str, rows: usize, cols: usize| w.get(&format!("{p}{name}"), &[rows, cols]);
        let (mut matmul_params, mut stacked_params) = (0usize, 0usize);
        let mut mat = |t: Tensor| -> Result<O::Mat> {
            matmul_params += t.len();
            ops.matrix(t.into())
        };
        let mut stack = |name: String, parts: Vec<Tensor>| -> Result<O::Mat> {
            stacked_params += parts.iter().map(|t| t.len()).sum::<usize>();
            ops.stacked(name, parts.into_iter().map(Into::into).collect())
        };
        let embed_t = tensor("embed_tokens.weight", cfg.vocab_size, h)?;
        let embed_params = embed_t.len();
        let embed = ops.table(embed_t.into())?;
        let mut layers = Vec::with_capacity(cfg.layers.len());
        for (i, lc) in cfg.layers.iter().enumerate() {
            let l = format!("{p}layers.{i}.");
            let (hd, kvh) = (lc.head_dim, lc.kv_heads);
            let ple = match cfg.variant {
                Variant::V1 => None,
                Variant::V2 => Some(PleBlock {
                    gate: mat(tensor(&format!("layers.{i}.ple_block.per_layer_input_gate.weight"), cfg.ple_dim, h)?)?,
                    proj: mat(tensor(&format!("layers.{i}.ple_block.per_layer_projection.weight"), h, cfg.ple_dim)?)?,
                    post_norm: norm(&format!("layers.{i}.ple_block.post_per_layer_input_norm.weight"), h)?,
                }),
            };
            let layer_scalar = match cfg.variant {
                Variant::V2 if w.contains(&format!("{l}layer_scalar")) => w.get(&format!("{l}layer_scalar"), &[1])?.data()[0],
                _ => 1.0,
            };
            let li = format!("layers.{i}.");
            let wqkv = stack(
                format!("{l}self_attn.qkv"),
                vec![
                    tensor(&format!("{li}self_attn.q_proj.weight"), cfg.q_heads * hd, h)?,
                    tensor(&format!("{li}self_attn.k_proj.weight"), kvh * hd, h)?,
                    tensor(&format!("{li}self_attn.v_proj.weight"), kvh * hd, h)?,
                ],
            )?;
            let gate_up = stack(
                format!("{l}mlp.gate_up"),
                vec![
                    tensor(&format!("{li}mlp.gate_proj.weight"), cfg.intermediate, h)?,
                    tensor(&format!("{li}mlp.up_proj.weight"), cfg.intermediate, h)?,
                ],
            )?;
            layers.push(Layer {
                cfg: lc.clone(),
                wqkv,
                wo: mat(tensor(&format!("{li}self_attn.o_proj.weight"), h, cfg.q_heads * hd)?)?,
                q_norm: norm(&format!("{li}self_attn.q_norm.weight"), hd)?,
                k_norm: norm(&format!("{li}self_attn.k_norm.weight"), hd)?,
                input_norm: norm(&format!("{li}input_layernorm.weight"), h)?,
                post_attn_norm: norm(&format!("{li}post_attention_layernorm.weight"), h)?,
                pre_ff_norm: norm(&format!("{li}pre_feedforward_layernorm.weight"), h)?,
                post_ff_norm: norm(&format!("{li}post_feedforward_layernorm.weight"), h)?,
                gate_up,
                down: mat(tensor(&format!("{li}mlp.down_proj.weight"), h, cfg.intermediate)?)?,
                ple,
                layer_scalar,
            });
        }
        let (ple_projection, out_projection) = match cfg.variant {
            Variant::V1 => (None, None),
            Variant::V2 => (
                Some((
                    mat(tensor("ple.per_layer_model_projection.weight", cfg.layers.len() * cfg.ple_dim, h)?)?,
                    norm("ple.per_layer_projection_norm.weight", cfg.ple_dim)?,
                )),
                Some(mat(tensor("embedding_projection.weight", cfg.out_dim, h)?)?),
            ),
        };
        let full_hd = cfg.layers.iter().find(|l| l.kind == LayerKind::Full).map_or(cfg.layers[0].head_dim, |l| l.head_dim);
        let sliding_hd = cfg.layers.iter().find(|l| l.kind == LayerKind::Sliding).map_or(full_hd, |l| l.head_dim);
        let positions = max_positions.min(cfg.max_positions).max(1);
        Ok(Encoder {
            embed_scale: (h as f64).sqrt() as f32,
            embed,
            layers,
            final_norm: norm("norm.weight", h)?,
            ple_projection,
            out_projection,
            rope_full: ops.rope(RopeTable::new(cfg.rope_theta_full, full_hd, positions))?,
            rope_sliding: ops.rope(RopeTable::new(cfg.rope_theta_sliding, sliding_hd, positions))?,
            positions,
            embed_params,
            matmul_params: matmul_params + stacked_params,
            ops,
            cfg,
        })
    }

    /// The backend the weights live on.
    pub fn ops(&self) -> &O {
        &self.ops
    }

    /// Longest sequence this encoder was prepared for.
    pub fn max_positions(&self) -> usize {
        self.positions
    }

    /// Parameters held (embedding table and projections); ×4 is the f32 weight bytes.
    pub fn param_count(&self) -> usize {
        self.embed_params + self.matmul_params
    }

    /// Weights every token multiplies through (all projections; the embedding table is a
    /// lookup): 2× this is the matmul FLOPs per token.
    pub fn matmul_params_per_token(&self) -> usize {
        self.matmul_params - self.out_projection.as_ref().map_or(0, |_| self.cfg.out_dim * self.cfg.hidden)
    }

    /// FLOPs of the attention products (QKᵀ and PV) for one sequence of `len` tokens.
    pub fn attention_flops(&self, len: usize) -> f64 {
        let radius = self.cfg.window_max_distance();
        self.layers
            .iter()
            .map(|l| {
                // Keys visible to each query, summed over the queries.
                let visible: usize = match l.cfg.kind {
                    LayerKind::Full => len * len,
                    LayerKind::Sliding => (0..len).map(|i| (i + radius + 1).min(len) - i.saturating_sub(radius)).sum(),
                };
                4.0 * (self.cfg.q_heads * l.cfg.head_dim) as f64 * visible as f64
            })
            .sum()
    }

    /// Checks a packed batch against the model's limits and vocabulary and returns the ids
    /// the lookup uses (multimodal placeholders mapped to the pad id).
    pub fn checked_ids(&self, ids: &[u32], segments: &[Segment]) -> Result<Vec<u32>> {
        let rows: usize = segments.last().map(|s| s.start + s.len).unwrap_or(0);
        if rows != ids.len() {
            return Err(Error::Shape(format!("forward: {} ids for segments covering {rows} rows", ids.len())));
        }
        if let Some(s) = segments.iter().find(|s| s.len > self.max_positions()) {
            return Err(Error::Input(format!(
                "a sequence of {} tokens exceeds the model's limit of {}",
                s.len,
                self.max_positions()
            )));
        }
        let cfg = &self.cfg;
        let ids: Vec<u32> = ids.iter().map(|&id| if cfg.placeholder_ids.contains(&id) { cfg.pad_id } else { id }).collect();
        check_ids(&ids, cfg.vocab_size)?;
        Ok(ids)
    }

    /// Runs the packed sequences `ids` (laid out by `segments`) and returns the mean-pooled
    /// final states, [segments][out_dim], on the backend.
    pub fn forward(&self, ids: &[u32], segments: &[Segment]) -> Result<O::Buf> {
        let batch = self.prepare(ids, segments)?;
        self.forward_batch(&batch)
    }

    /// The checked batch of `ids` laid out by `segments`, on the backend.
    pub fn prepare(&self, ids: &[u32], segments: &[Segment]) -> Result<O::Batch> {
        let ids = self.checked_ids(ids, segments)?;
        self.ops.batch(segments, &ids)
    }

    /// [`Encoder::forward`] of a prepared batch: only kernels, no host transfer, so a backend
    /// may record it once and replay it.
    pub fn forward_batch(&self, batch: &O::Batch) -> Result<O::Buf> {
        let (ops, cfg) = (&self.ops, &self.cfg);
        let segments = ops.segments(batch);
        let (t, h) = (segments.last().map_or(0, |s| s.start + s.len), cfg.hidden);
        let mut x = ops.embed(&self.embed, batch, self.embed_scale)?;
        // V2: per-layer inputs rms(Linear(x)·hidden^-½) per P-wide group, [t][L·P]; layer l
        // reads its group as a strided view.
        let ple = match &self.ple_projection {
            None => None,
            Some((proj, norm_w)) => {
                let p = ops.linear(&x, t, proj, None)?;
                let scale = (h as f64).powf(-0.5) as f32;
                Some(ops.rms_norm(&p, cfg.ple_dim, Some(norm_w), scale, cfg.eps)?)
            }
        };
        let mut a = ops.rms_norm(&x, h, Some(&self.layers[0].input_norm), 1.0, cfg.eps)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let next_norm = self.layers.get(i + 1).map_or(&self.final_norm, |l| &l.input_norm);
            self.layer_forward(i, layer, &mut x, &mut a, t, ple.as_ref(), batch, next_norm)?;
        }
        // `a` now holds rms(x)·w_final for every row.
        let pooled = ops.mean_pool(&a, h, batch)?;
        match &self.out_projection {
            // Projecting each token then pooling equals pooling then projecting (linearity);
            // the latter is `len` times cheaper and differs only in rounding.
            Some(w) => ops.linear(&pooled, segments.len(), w, None),
            None => Ok(pooled),
        }
    }

    /// One layer; leaves the next layer's normalised input in `a`.
    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        index: usize,
        layer: &Layer<O>,
        x: &mut O::Buf,
        a: &mut O::Buf,
        t: usize,
        ple: Option<&O::Buf>,
        batch: &O::Batch,
        next_norm: &O::Vector,
    ) -> Result<()> {
        let (ops, cfg) = (&self.ops, &self.cfg);
        let h = cfg.hidden;
        let LayerConfig { kind, head_dim: hd, kv_heads } = layer.cfg;
        let rope = match kind {
            LayerKind::Full => &self.rope_full,
            LayerKind::Sliding => &self.rope_sliding,
        };
        let (qw, kw) = (cfg.q_heads * hd, kv_heads * hd);
        let ld = qw + 2 * kw;
        let mut qkv = ops.linear(a, t, &layer.wqkv, None)?;
        let q_prep = HeadOps::<O> { heads: cfg.q_heads, hd, norm: Some(Some(&layer.q_norm)), eps: cfg.eps, rope: Some(rope) };
        let k_prep = HeadOps::<O> { heads: kv_heads, norm: Some(Some(&layer.k_norm)), ..q_prep };
        let mut sections = vec![(0, q_prep), (qw, k_prep)];
        if cfg.variant == Variant::V2 {
            sections.push((qw + kw, HeadOps::<O> { heads: kv_heads, hd, norm: Some(None), eps: cfg.eps, rope: None }));
        }
        ops.head_prep(&mut qkv, ld, batch, &sections)?;
        let shape = AttentionShape {
            q_heads: cfg.q_heads,
            kv_heads,
            hd,
            scale: cfg.attention_scale,
            max_distance: (kind == LayerKind::Sliding).then(|| cfg.window_max_distance()),
        };
        let qkv_views = (View::new(&qkv, 0, ld), View::new(&qkv, qw, ld), View::new(&qkv, qw + kw, ld));
        let post_attn = SandwichNorm { weight: &layer.post_attn_norm, post: 1.0, d: h, eps: cfg.eps };
        ops.attention_add_norm_next(qkv_views, batch, &shape, t, &layer.wo, x, post_attn, &layer.pre_ff_norm, a)?;
        drop(qkv);
        let ffn = (&layer.gate_up, cfg.intermediate, GatedActivation::GeluTanh);
        let post_ff = SandwichNorm { weight: &layer.post_ff_norm, post: 1.0, d: h, eps: cfg.eps };
        match (&layer.ple, ple) {
            (Some(block), Some(ple)) => {
                ops.ffn_add_norm(a, t, ffn, &layer.down, x, post_ff, None)?;
                let (pd, nl) = (cfg.ple_dim, cfg.layers.len());
                let pg = ops.linear_gelu_mul(x, t, &block.gate, pd, View::new(ple, index * pd, nl * pd))?;
                let p = ops.linear(&pg, t, &block.proj, None)?;
                ops.add_norm_next(x, &p, &block.post_norm, layer.layer_scalar, h, cfg.eps, next_norm, a)
            }
            _ => ops.ffn_add_norm(a, t, ffn, &layer.down, x, post_ff, Some(next_norm)),
        }
    }
}
