//! A model larger than memory, run by a device map (Accelerate's
//! `load_checkpoint_and_dispatch`): each module's weights read from the checkpoint straight to
//! their place — a GPU, main memory, or the disk — and the modules on the disk read into
//! memory just before they run and released after (Accelerate's `AlignDevicesHook` with
//! offload). The whole model is never in memory at once.
//!
//! Disk offload reads from safetensors files: the checkpoint's own when the run keeps its
//! dtype (as Accelerate does for safetensors checkpoints), else files written to the offload
//! folder in the run's dtype, one per offloaded module. A module computing on the CPU maps its
//! files' pages (the kernel's page cache, no copy, as `safe_open` does) and unmaps them after
//! it ran; one computing on a GPU reads them into a fresh tensor and copies that over. Either
//! way a module's bytes count in this process's memory only while it runs.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use accel_core::HfCheckpoint;
use anyhow::{Context, Result, bail};
use tch::{Device, Kind, Tensor};

use super::{Llama, LlamaConfig};
use crate::device_map::{DeviceMap, Module, Place};

/// A module whose weights wait on the disk: its variables (released between uses) and the
/// file they are read from.
#[derive(Debug)]
pub(crate) struct Offloaded {
    checkpoint: HfCheckpoint,
    /// Each variable: its name in `checkpoint`, the model's tensor, and its dtype.
    vars: Vec<(String, Tensor, Kind)>,
    /// The file pages the variables point into while fetched: unmapped by `release`, only
    /// after the variables have let go of them.
    maps: Mutex<Vec<memmap2::Mmap>>,
}

/// How a dispatched model runs: where it computes, and what waits on the disk.
#[derive(Debug, Default)]
pub(crate) struct Dispatch {
    /// Offloaded modules by prefix (`model.layers.7`, `lm_head`).
    pub(crate) offloaded: BTreeMap<String, Offloaded>,
    /// Where each module computes, by prefix (a GPU it lives on; else the first GPU of the
    /// map; else the CPU).
    pub(crate) devices: BTreeMap<String, Device>,
}

impl Dispatch {
    /// Reads module `prefix`'s weights (if offloaded) onto `device`.
    pub(crate) fn fetch(&self, prefix: &str, device: Device) -> Result<()> {
        let Some(module) = self.offloaded.get(prefix) else { return Ok(()) };
        for (name, var, kind) in &module.vars {
            if device == Device::Cpu {
                if let Some((value, map)) = mapped(&module.checkpoint, name, *kind)? {
                    tch::no_grad(|| var.shallow_clone().set_data(&value));
                    module.maps.lock().unwrap_or_else(|e| e.into_inner()).push(map);
                    continue;
                }
            }
            let value = module.checkpoint.read(name)?.to_kind(*kind).to_device(device);
            tch::no_grad(|| var.shallow_clone().set_data(&value));
        }
        Ok(())
    }

    /// Releases module `prefix`'s weights again (if offloaded).
    pub(crate) fn release(&self, prefix: &str) -> Result<()> {
        let Some(module) = self.offloaded.get(prefix) else { return Ok(()) };
        for (_, var, _) in &module.vars {
            release(var)?;
        }
        // Nothing points into the pages any more: unmap them.
        let mut maps = module.maps.lock().unwrap_or_else(|e| e.into_inner());
        let read = module.vars.len() - maps.len();
        maps.clear();
        // What was read rather than mapped lies on the heap: the accelerator keeps freed memory
        // for the next training step, but here the next module is another one, so it goes
        // back to the kernel.
        if read > 0 {
            accel_core::heap::release_free_memory();
        }
        Ok(())
    }

    /// The device module `prefix` computes on.
    pub(crate) fn device(&self, prefix: &str) -> Option<Device> {
        self.devices.get(prefix).copied()
    }
}

/// Tensor `name` of `checkpoint` as its file's pages, mapped read-only, and the mapping
/// (which must outlive every use of the tensor); `None` where it cannot be used as it lies
/// (another dtype than `kind`, no bytes, or misaligned for its dtype).
fn mapped(
    checkpoint: &HfCheckpoint,
    name: &str,
    kind: Kind,
) -> Result<Option<(Tensor, memmap2::Mmap)>> {
    let (path, start, stored, shape) = checkpoint.location(name)?;
    let elt = stored.elt_size_in_bytes();
    let bytes = shape.iter().product::<i64>() as usize * elt;
    if stored != kind || bytes == 0 || start % elt as u64 != 0 {
        return Ok(None);
    }
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: the offload files and the checkpoint are not written while the model runs (the
    // folder is the run's own; a checkpoint changed under a running model is refused by no
    // one, as with `safe_open`). `populate` faults the pages in at once.
    let map = unsafe { memmap2::MmapOptions::new().offset(start).len(bytes).populate().map(&file) }
        .with_context(|| format!("mapping `{name}` from {}", path.display()))?;
    let mut strides = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    // SAFETY: `map` holds exactly the tensor's `bytes`, aligned for its dtype (the file offset
    // is, and mappings start on a page); the tensor is read only (inference, no gradients) and
    // the caller keeps `map` until nothing uses the tensor.
    let tensor = unsafe { Tensor::f_from_blob(map.as_ptr(), shape, &strides, kind, Device::Cpu)? };
    Ok(Some((tensor, map)))
}

/// `var` without memory (its shape kept), until a fetch fills it.
fn release(var: &Tensor) -> Result<()> {
    release_as(var, var.kind())
}

/// [`release`] with dtype `kind`, on the CPU.
fn release_as(var: &Tensor, kind: Kind) -> Result<()> {
    let like = Tensor::empty([0], (kind, Device::Cpu));
    let released = accel_core::shim::released(&like, var)?;
    tch::no_grad(|| var.shallow_clone().set_data(&released));
    Ok(())
}

/// The model's modules for [`crate::device_map::infer_auto_device_map`], as transformers'
/// `LlamaForCausalLM` nests them (`model` → `embed_tokens`, `layers` → each layer, `norm`,
/// `rotary_emb`; `lm_head`), each layer whole (its `_no_split_modules`), sized in `kind`.
/// A tied head has no bytes of its own and goes with the embedding.
pub fn modules(config: &LlamaConfig, kind: Kind) -> Module {
    let elt = kind.elt_size_in_bytes() as u64;
    let (h, i, d) =
        (config.hidden_size as u64, config.intermediate_size as u64, config.head_dim as u64);
    let (heads, kv) = (config.num_attention_heads as u64, config.num_key_value_heads as u64);
    let mut attn = h * heads * d + 2 * h * kv * d + heads * d * h;
    if config.qkv_bias {
        attn += heads * d + 2 * kv * d;
    }
    if config.o_bias {
        attn += h;
    }
    let mut mlp = 3 * h * i;
    if config.mlp_bias {
        mlp += 2 * i + h;
    }
    let norms = 2 * h + if config.qk_norm { 2 * d } else { 0 };
    let layer = (attn + mlp + norms) * elt;
    let layers: Vec<Module> = (0..config.num_hidden_layers)
        .map(|n| Module { whole: true, ..Module::leaf(format!("model.layers.{n}"), layer) })
        .collect();
    let embed_bytes = config.vocab_size as u64 * h * elt;
    let tied = if config.tie_word_embeddings { vec!["lm_head".to_owned()] } else { Vec::new() };
    let embed = Module { tied_to: tied.clone(), ..Module::leaf("model.embed_tokens", embed_bytes) };
    let layer_list = Module {
        parts: layers,
        ..Module::leaf("model.layers", layer * config.num_hidden_layers as u64)
    };
    // transformers' rotary embedding holds inv_freq, a buffer of head_dim / 2 values.
    let rotary = Module::leaf("model.rotary_emb", d / 2 * elt);
    let norm = Module::leaf("model.norm", h * elt);
    let inner_bytes = embed.bytes + layer_list.bytes + norm.bytes + rotary.bytes;
    let inner = Module {
        parts: vec![embed, layer_list, norm, rotary],
        tied_to: tied,
        ..Module::leaf("model", inner_bytes)
    };
    let head_bytes = if config.tie_word_embeddings { 0 } else { embed_bytes };
    let head = Module::leaf("lm_head", head_bytes);
    Module { parts: vec![inner, head], ..Module::leaf("", inner_bytes + head_bytes) }
}

/// The module a variable belongs to, for fetching: the layer, the embedding, the norm or the
/// head.
fn module_of(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    match parts.as_slice() {
        ["model", "layers", i, ..] => format!("model.layers.{i}"),
        ["model", m, ..] => format!("model.{m}"),
        [m, ..] => (*m).to_owned(),
        [] => String::new(),
    }
}

/// A safetensors file of `tensors` (contiguous, on the CPU) written without a copy of their
/// bytes in memory: the header, then each tensor's data straight from its storage.
fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, t) in tensors {
        let bytes = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        let dtype = match t.kind() {
            Kind::Float => "F32",
            Kind::BFloat16 => "BF16",
            Kind::Half => "F16",
            other => bail!("offloading `{name}`: dtype {other:?} is not a float type"),
        };
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": t.size(), "data_offsets": [offset, offset + bytes] }),
        );
        offset += bytes;
    }
    let mut text = serde_json::to_string(&header)?;
    while text.len() % 8 != 0 {
        text.push(' ');
    }
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut file = std::io::BufWriter::new(file);
    file.write_all(&(text.len() as u64).to_le_bytes())?;
    file.write_all(text.as_bytes())?;
    for (_, t) in tensors {
        let bytes = t.numel() * t.kind().elt_size_in_bytes();
        // SAFETY: `t` is contiguous on the CPU and alive for the slice's use; its storage
        // holds `bytes` bytes from its data pointer.
        let data = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, bytes) };
        file.write_all(data)?;
    }
    file.flush().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

impl Llama {
    /// The model of Hugging Face folder `dir`, its variables in `vs` (whose tensors it
    /// keeps), placed by `map` in dtype `kind`, never whole in memory: each module read from
    /// the checkpoint straight to its place, modules on the disk left there (their files in
    /// `offload_folder` when `kind` is not the checkpoint's) and read just before they run.
    /// For inference: [`Llama::forward_cached`] and [`Llama::generate`] run it.
    pub fn dispatch(
        acc: &accel_core::Accelerator,
        vs: &tch::nn::VarStore,
        dir: impl AsRef<Path>,
        map: &DeviceMap,
        offload_folder: Option<&Path>,
        kind: Kind,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let mut model = Self::unloaded(acc, vs, dir)?;
        let checkpoint = HfCheckpoint::open(dir)?;
        let compute = map
            .places()
            .into_iter()
            .find_map(|p| match p {
                Place::Gpu(i) => Some(Device::Cuda(i)),
                _ => None,
            })
            .unwrap_or(Device::Cpu);
        // Variables by module, in the model's order.
        let mut by_module: Vec<(String, Vec<(String, Tensor)>)> = Vec::new();
        let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        variables.sort_by_key(|(n, _)| order_key(n));
        for (name, var) in variables {
            let module = module_of(&name);
            match by_module.last_mut() {
                Some((m, vars)) if *m == module => vars.push((name, var)),
                _ => by_module.push((module, vec![(name, var)])),
            }
        }
        let mut dispatch = Dispatch::default();
        let same_dtype = |name: &str| checkpoint.read_range(name, 0, 0).map(|t| t.kind() == kind);
        for (module, vars) in by_module {
            let place = map.place_of(&module).with_context(|| {
                format!("the device map places nothing at `{module}`; give every module a place")
            })?;
            let device = match place {
                Place::Gpu(i) => Device::Cuda(i),
                _ => compute,
            };
            dispatch.devices.insert(module.clone(), device);
            if place != Place::Disk {
                let at = if let Place::Gpu(i) = place { Device::Cuda(i) } else { Device::Cpu };
                for (name, var) in &vars {
                    let value = checkpoint.read(name)?.to_kind(kind).to_device(at);
                    tch::no_grad(|| var.shallow_clone().set_data(&value));
                }
                continue;
            }
            let direct =
                vars.iter().map(|(n, _)| same_dtype(n)).collect::<accel_core::Result<Vec<_>>>()?;
            let file = if direct.iter().all(|d| *d) {
                None
            } else {
                let folder = offload_folder.with_context(|| {
                    format!(
                        "`{module}` goes to the disk in {kind:?}, which is not the checkpoint's \
                         dtype: give an offload folder to write it to"
                    )
                })?;
                std::fs::create_dir_all(folder)
                    .with_context(|| format!("creating {}", folder.display()))?;
                let path: PathBuf = folder.join(format!("{module}.safetensors"));
                let mut tensors = Vec::new();
                for (name, _) in &vars {
                    tensors.push((name.clone(), checkpoint.read(name)?.to_kind(kind).contiguous()));
                }
                write_safetensors(&path, &tensors)?;
                drop(tensors);
                accel_core::heap::release_free_memory();
                Some(path)
            };
            let source = match &file {
                Some(path) => HfCheckpoint::open(path)?,
                None => HfCheckpoint::open(dir)?,
            };
            let mut kept = Vec::new();
            for (name, var) in vars {
                release_as(&var, kind)?;
                kept.push((name, var, kind));
            }
            dispatch.offloaded.insert(
                module,
                Offloaded { checkpoint: source, vars: kept, maps: Mutex::default() },
            );
        }
        model.dispatch = Some(dispatch);
        Ok(model)
    }
}

/// Variables sorted as the forward pass meets them: the embedding, the layers in order,
/// the norm, the head.
fn order_key(name: &str) -> (usize, usize, String) {
    let parts: Vec<&str> = name.split('.').collect();
    match parts.as_slice() {
        ["model", "embed_tokens", ..] => (0, 0, name.to_owned()),
        ["model", "layers", i, ..] => (1, i.parse().unwrap_or(0), name.to_owned()),
        ["model", ..] => (2, 0, name.to_owned()),
        _ => (3, 0, name.to_owned()),
    }
}
