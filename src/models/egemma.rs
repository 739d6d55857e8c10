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
use crate::kernels::activation::gelu_tanh_mul;
use crate::kernels::attention::{attention, AttentionShape};
use crate::kernels::matmul::linear;
use crate::kernels::norm::{add_norm, rms_norm};
use crate::kernels::pool::mean_pool;
use crate::kernels::rope::{head_prep, HeadPrep, RopeTable};
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

struct PleBlock {
    gate: Tensor,
    proj: Tensor,
    post_norm: Vec<f32>,
}

struct Layer {
    cfg: LayerConfig,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    input_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    pre_ff_norm: Vec<f32>,
    post_ff_norm: Vec<f32>,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    ple: Option<PleBlock>,
    layer_scalar: f32,
}

/// A loaded encoder: token ids in, pooled sequence vectors out.
pub struct Encoder {
    pub cfg: EncoderConfig,
    embed: Tensor,
    embed_scale: f32,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// V2: per-layer-input projection [L·P][hidden] and its norm weight [P].
    ple_projection: Option<(Tensor, Vec<f32>)>,
    /// V2: `embedding_projection` [out_dim][hidden].
    out_projection: Option<Tensor>,
    rope_full: RopeTable,
    rope_sliding: RopeTable,
}

impl Encoder {
    /// Loads the weights of `dir`, checking every shape against the config. Positions up to
    /// `max_positions` get RoPE tables.
    pub fn load(dir: &Path, max_positions: usize) -> Result<Encoder> {
        let cfg = EncoderConfig::from_dir(dir)?;
        let w = SafetensorsWeights::open_dir(dir)?;
        let p = &cfg.prefix;
        let h = cfg.hidden;
        // V1 stores w for a (1 + w) norm: add the one here, the same f32 addition as the
        // reference's forward. V2 multiplies by w directly.
        let norm = |name: &str, d: usize| -> Result<Vec<f32>> {
            let t = w.get(&format!("{p}{name}"), &[d])?;
            Ok(match cfg.variant {
                Variant::V1 => t.data().iter().map(|&x| 1.0 + x).collect(),
                Variant::V2 => t.data().to_vec(),
            })
        };
        let mat = |name: &str, rows: usize, cols: usize| w.get(&format!("{p}{name}"), &[rows, cols]);
        let embed = mat("embed_tokens.weight", cfg.vocab_size, h)?;
        let mut layers = Vec::with_capacity(cfg.layers.len());
        for (i, lc) in cfg.layers.iter().enumerate() {
            let l = format!("layers.{i}.");
            let (hd, kvh) = (lc.head_dim, lc.kv_heads);
            let ple = match cfg.variant {
                Variant::V1 => None,
                Variant::V2 => Some(PleBlock {
                    gate: mat(&format!("{l}ple_block.per_layer_input_gate.weight"), cfg.ple_dim, h)?,
                    proj: mat(&format!("{l}ple_block.per_layer_projection.weight"), h, cfg.ple_dim)?,
                    post_norm: norm(&format!("{l}ple_block.post_per_layer_input_norm.weight"), h)?,
                }),
            };
            let layer_scalar = match cfg.variant {
                Variant::V2 if w.contains(&format!("{p}{l}layer_scalar")) => {
                    w.get(&format!("{p}{l}layer_scalar"), &[1])?.data()[0]
                }
                _ => 1.0,
            };
            layers.push(Layer {
                cfg: lc.clone(),
                wq: mat(&format!("{l}self_attn.q_proj.weight"), cfg.q_heads * hd, h)?,
                wk: mat(&format!("{l}self_attn.k_proj.weight"), kvh * hd, h)?,
                wv: mat(&format!("{l}self_attn.v_proj.weight"), kvh * hd, h)?,
                wo: mat(&format!("{l}self_attn.o_proj.weight"), h, cfg.q_heads * hd)?,
                q_norm: norm(&format!("{l}self_attn.q_norm.weight"), hd)?,
                k_norm: norm(&format!("{l}self_attn.k_norm.weight"), hd)?,
                input_norm: norm(&format!("{l}input_layernorm.weight"), h)?,
                post_attn_norm: norm(&format!("{l}post_attention_layernorm.weight"), h)?,
                pre_ff_norm: norm(&format!("{l}pre_feedforward_layernorm.weight"), h)?,
                post_ff_norm: norm(&format!("{l}post_feedforward_layernorm.weight"), h)?,
                gate: mat(&format!("{l}mlp.gate_proj.weight"), cfg.intermediate, h)?,
                up: mat(&format!("{l}mlp.up_proj.weight"), cfg.intermediate, h)?,
                down: mat(&format!("{l}mlp.down_proj.weight"), h, cfg.intermediate)?,
                ple,
                layer_scalar,
            });
        }
        let (ple_projection, out_projection) = match cfg.variant {
            Variant::V1 => (None, None),
            Variant::V2 => (
                Some((
                    mat("ple.per_layer_model_projection.weight", cfg.layers.len() * cfg.ple_dim, h)?,
                    norm("ple.per_layer_projection_norm.weight", cfg.ple_dim)?,
                )),
                Some(mat("embedding_projection.weight", cfg.out_dim, h)?),
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
            rope_full: RopeTable::new(cfg.rope_theta_full, full_hd, positions),
            rope_sliding: RopeTable::new(cfg.rope_theta_sliding, sliding_hd, positions),
            cfg,
        })
    }

    /// Longest sequence this encoder was prepared for.
    pub fn max_positions(&self) -> usize {
        self.rope_full.positions()
    }

    /// Bytes of weights held (mapped or owned).
    pub fn weight_bytes(&self) -> usize {
        (self.embed.len() + self.matmul_params_per_token()) * 4
    }

    /// Weights every token multiplies through (all projections; the embedding table is a
    /// lookup): 2× this is the matmul FLOPs per token.
    pub fn matmul_params_per_token(&self) -> usize {
        let mut n = self.ple_projection.as_ref().map_or(0, |(p, _)| p.len());
        for l in &self.layers {
            n += [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down].iter().map(|t| t.len()).sum::<usize>();
            n += l.ple.as_ref().map_or(0, |b| b.gate.len() + b.proj.len());
        }
        n
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

    /// Runs the packed sequences `ids` (laid out by `segments`) and returns the mean-pooled
    /// final states, [segments][out_dim].
    pub fn forward(&self, ids: &[u32], segments: &[Segment]) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let (t, h) = (ids.len(), cfg.hidden);
        let rows: usize = segments.last().map(|s| s.start + s.len).unwrap_or(0);
        if rows != t {
            return Err(Error::Shape(format!("forward: {t} ids for segments covering {rows} rows")));
        }
        let mut positions = Vec::with_capacity(t);
        for s in segments {
            if s.len > self.max_positions() {
                return Err(Error::Input(format!(
                    "a sequence of {} tokens exceeds the model's limit of {}",
                    s.len,
                    self.max_positions()
                )));
            }
            positions.extend(0..s.len as u32);
        }
        // Embedding lookup × √hidden.
        let table = self.embed.data();
        let mut x = vec![0.0f32; t * h];
        for (row, &id) in x.chunks_mut(h).zip(ids) {
            let id = if cfg.placeholder_ids.contains(&id) { cfg.pad_id } else { id };
            if id as usize >= cfg.vocab_size {
                return Err(Error::Input(format!("token id {id} is outside the vocabulary of {}", cfg.vocab_size)));
            }
            let src = &table[id as usize * h..(id as usize + 1) * h];
            row.iter_mut().zip(src).for_each(|(o, &e)| *o = e * self.embed_scale);
        }
        // V2: per-layer inputs rms(reshape(Linear(x)·hidden^-½)), regrouped as [layer][t][P].
        let ple = match &self.ple_projection {
            None => None,
            Some((proj, norm_w)) => {
                let (nl, pd) = (cfg.layers.len(), cfg.ple_dim);
                let mut p = linear(&x, t, proj.data(), nl * pd, h)?;
                let scale = (h as f64).powf(-0.5) as f32;
                p.iter_mut().for_each(|v| *v *= scale);
                let mut normed = vec![0.0f32; p.len()];
                rms_norm(&p, pd, Some(norm_w), 1.0, cfg.eps, &mut normed)?;
                let mut by_layer = vec![0.0f32; p.len()];
                for r in 0..t {
                    for l in 0..nl {
                        by_layer[(l * t + r) * pd..(l * t + r + 1) * pd]
                            .copy_from_slice(&normed[(r * nl + l) * pd..(r * nl + l + 1) * pd]);
                    }
                }
                Some(by_layer)
            }
        };
        let mut a = vec![0.0f32; t * h];
        rms_norm(&x, h, Some(&self.layers[0].input_norm), 1.0, cfg.eps, &mut a)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let next_norm = self.layers.get(i + 1).map_or(&self.final_norm, |l| &l.input_norm);
            self.layer_forward(i, layer, &mut x, &mut a, ple.as_deref(), &positions, segments, next_norm)?;
        }
        // `a` now holds rms(x)·w_final for every row.
        let pooled = mean_pool(&a, h, segments)?;
        match &self.out_projection {
            // Projecting each token then pooling equals pooling then projecting (linearity);
            // the latter is `len` times cheaper and differs only in rounding.
            Some(w) => linear(&pooled, segments.len(), w.data(), cfg.out_dim, h),
            None => Ok(pooled),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        index: usize,
        layer: &Layer,
        x: &mut [f32],
        a: &mut [f32],
        ple: Option<&[f32]>,
        positions: &[u32],
        segments: &[Segment],
        next_norm: &[f32],
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (t, h) = (positions.len(), cfg.hidden);
        let LayerConfig { kind, head_dim: hd, kv_heads } = layer.cfg;
        let rope = match kind {
            LayerKind::Full => &self.rope_full,
            LayerKind::Sliding => &self.rope_sliding,
        };
        let mut q = linear(a, t, layer.wq.data(), cfg.q_heads * hd, h)?;
        let mut k = linear(a, t, layer.wk.data(), kv_heads * hd, h)?;
        let mut v = linear(a, t, layer.wv.data(), kv_heads * hd, h)?;
        let q_prep = HeadPrep { heads: cfg.q_heads, hd, norm: Some(Some(&layer.q_norm)), eps: cfg.eps, rope: Some(rope) };
        head_prep(&mut q, t, positions, &q_prep)?;
        let k_prep = HeadPrep { heads: kv_heads, norm: Some(Some(&layer.k_norm)), ..q_prep };
        head_prep(&mut k, t, positions, &k_prep)?;
        if cfg.variant == Variant::V2 {
            let v_prep = HeadPrep { heads: kv_heads, hd, norm: Some(None), eps: cfg.eps, rope: None };
            head_prep(&mut v, t, positions, &v_prep)?;
        }
        let shape = AttentionShape {
            q_heads: cfg.q_heads,
            kv_heads,
            hd,
            scale: cfg.attention_scale,
            max_distance: (kind == LayerKind::Sliding).then(|| cfg.window_max_distance()),
        };
        // q is dead after attention: reuse its buffer for the output.
        let mut att = vec![0.0f32; q.len()];
        attention(&q, &k, &v, segments, &shape, &mut att)?;
        drop((q, k, v));
        let o = linear(&att, t, layer.wo.data(), h, cfg.q_heads * hd)?;
        add_norm(x, &o, &layer.post_attn_norm, 1.0, h, cfg.eps, Some((&layer.pre_ff_norm, a)))?;
        let mut g = linear(a, t, layer.gate.data(), cfg.intermediate, h)?;
        let u = linear(a, t, layer.up.data(), cfg.intermediate, h)?;
        gelu_tanh_mul(&mut g, &u)?;
        drop(u);
        let m = linear(&g, t, layer.down.data(), h, cfg.intermediate)?;
        match (&layer.ple, ple) {
            (Some(block), Some(ple)) => {
                add_norm(x, &m, &layer.post_ff_norm, 1.0, h, cfg.eps, None)?;
                let pd = cfg.ple_dim;
                let mut pg = linear(x, t, block.gate.data(), pd, h)?;
                gelu_tanh_mul(&mut pg, &ple[index * t * pd..(index + 1) * t * pd])?;
                let p = linear(&pg, t, block.proj.data(), h, pd)?;
                add_norm(x, &p, &block.post_norm, layer.layer_scalar, h, cfg.eps, Some((next_norm, a)))?;
            }
            _ => add_norm(x, &m, &layer.post_ff_norm, 1.0, h, cfg.eps, Some((next_norm, a)))?,
        }
        Ok(())
    }
}
