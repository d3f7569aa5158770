//! Big-model inference's placement, as Accelerate does it: memory budgets per device
//! (`max_memory`, "2GiB" or a number of bytes), a model's modules with their sizes, and
//! [`infer_auto_device_map`] — Accelerate's algorithm, which fills each device in turn
//! (GPUs, then the CPU, then the disk) in the model's order, never splits a module marked
//! whole (a decoder layer), keeps tied weights together, and leaves room on the main devices
//! for the largest layer an offloaded one needs there when it runs.
//!
//! The map is printed as Accelerate prints `hf_device_map` (`{'model.embed_tokens': 0, ...,
//! 'lm_head': 'disk'}`) and read back from JSON (`{"model.embed_tokens": 0, "lm_head":
//! "disk"}`).

use std::collections::BTreeMap;
use std::fmt;

use anyhow::{Context, Result, bail};

/// Where a module's weights live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Place {
    /// GPU `i` (`cuda:i`).
    Gpu(usize),
    /// Main memory.
    Cpu,
    /// Files, read into memory just before the module runs and released after.
    Disk,
}

impl fmt::Display for Place {
    /// As Accelerate writes it in a device map: `0`, `'cpu'`, `'disk'`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gpu(i) => write!(f, "{i}"),
            Self::Cpu => f.write_str("'cpu'"),
            Self::Disk => f.write_str("'disk'"),
        }
    }
}

impl std::str::FromStr for Place {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().trim_matches(|c| c == '\'' || c == '"');
        match s {
            "cpu" => Ok(Self::Cpu),
            "disk" => Ok(Self::Disk),
            _ => {
                let gpu = s.strip_prefix("cuda:").unwrap_or(s);
                gpu.parse().map(Self::Gpu).map_err(|_| {
                    anyhow::anyhow!("device `{s}`: expected a GPU index (0, cuda:1), cpu or disk")
                })
            }
        }
    }
}

/// Bytes of a size written as Accelerate's `convert_file_size_to_int` reads it: a number of
/// bytes, or a number with a unit — KiB/MiB/GiB/TiB (powers of 1024), KB/MB/GB/TB (powers of
/// 1000); a lower-case `b` after a decimal unit means bits ("5Gb").
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    if let Ok(n) = t.parse::<u64>() {
        return Ok(n);
    }
    let units: [(&str, f64); 8] = [
        ("TiB", 1024f64.powi(4)),
        ("GiB", 1024f64.powi(3)),
        ("MiB", 1024f64.powi(2)),
        ("KiB", 1024.0),
        ("TB", 1e12),
        ("GB", 1e9),
        ("MB", 1e6),
        ("KB", 1e3),
    ];
    for (unit, factor) in units {
        let upper = t.to_ascii_uppercase();
        let bits = t.ends_with('b') && !unit.contains('i');
        if upper.ends_with(&unit.to_ascii_uppercase()) {
            let number = &t[..t.len() - unit.len()];
            let n: f64 = number.trim().parse().with_context(|| format!("size `{text}`"))?;
            let bytes = n * factor / if bits { 8.0 } else { 1.0 };
            return Ok(bytes as u64);
        }
    }
    bail!("size `{text}`: expected bytes or a number with KiB, MiB, GiB, TiB, KB, MB, GB or TB")
}

/// A memory budget per device (Accelerate's `max_memory`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MaxMemory(pub BTreeMap<Place, u64>);

impl MaxMemory {
    /// `"150MiB"` (the CPU's budget, and each listed GPU's) or `"0=2GiB,1=2GiB,cpu=8GiB"`.
    pub fn parse(text: &str, gpus: usize) -> Result<Self> {
        let mut budgets = BTreeMap::new();
        if !text.contains('=') {
            let bytes = parse_size(text)?;
            budgets.extend((0..gpus).map(|i| (Place::Gpu(i), bytes)));
            budgets.insert(Place::Cpu, bytes);
            return Ok(Self(budgets));
        }
        for part in text.split(',') {
            let (device, size) = part.split_once('=').with_context(|| {
                format!("max_memory `{part}`: expected DEVICE=SIZE, e.g. cpu=8GiB or 0=2GiB")
            })?;
            let place: Place = device.parse()?;
            if place == Place::Disk {
                bail!("max_memory: the disk has no budget (it takes what does not fit)");
            }
            budgets.insert(place, parse_size(size)?);
        }
        Ok(Self(budgets))
    }
}

/// A part of a model as the placement sees it: its name (its variables' prefix), the bytes
/// of its own variables (including everything below it), and its parts. A module without
/// parts, or marked `whole` (Accelerate's `no_split_module_classes`), is never split.
#[derive(Debug, Clone, PartialEq)]
pub struct Module {
    /// The variables' prefix (`model.layers.3`).
    pub name: String,
    /// Bytes of its variables in the dtype they will have.
    pub bytes: u64,
    /// Its parts, in the order the forward pass runs them.
    pub parts: Vec<Module>,
    /// Never split across devices.
    pub whole: bool,
    /// Variables it shares with another module (a tied head): their prefixes, which must
    /// go where this one goes.
    pub tied_to: Vec<String>,
}

impl Module {
    /// A module that is placed as one.
    pub fn leaf(name: impl Into<String>, bytes: u64) -> Self {
        Self { name: name.into(), bytes, parts: Vec::new(), whole: false, tied_to: Vec::new() }
    }

    /// The largest module that is never split (a layer, the embedding, the head): its
    /// name and bytes; what a main device keeps room for.
    pub fn largest_whole(&self) -> (String, u64) {
        let (bytes, names) = Self::largest_layer(std::slice::from_ref(self));
        (names.into_iter().next().unwrap_or_default(), bytes)
    }

    fn splittable(&self) -> bool {
        !self.whole && !self.parts.is_empty()
    }

    /// The largest unsplittable module among `modules` (and their parts): what a main
    /// device keeps room for. Its size and the names of the modules of that size.
    fn largest_layer(modules: &[Module]) -> (u64, Vec<String>) {
        let (mut size, mut names) = (0, Vec::new());
        let mut stack: Vec<&Module> = modules.iter().collect();
        while let Some(m) = stack.pop() {
            if m.splittable() {
                stack.extend(m.parts.iter());
            } else if m.bytes > size {
                (size, names) = (m.bytes, vec![m.name.clone()]);
            } else if m.bytes == size {
                names.push(m.name.clone());
            }
        }
        (size, names)
    }
}

/// Where each module goes, in the model's order; a module's entry covers everything under
/// its prefix (`""`: the whole model).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeviceMap(pub Vec<(String, Place)>);

impl DeviceMap {
    /// The place of variable `name`: its longest prefix in the map.
    pub fn place_of(&self, name: &str) -> Option<Place> {
        self.0
            .iter()
            .filter(|(prefix, _)| {
                prefix.is_empty() || name == prefix || name.starts_with(&format!("{prefix}."))
            })
            .max_by_key(|(prefix, _)| prefix.len())
            .map(|(_, place)| *place)
    }

    /// A map written as JSON: `{"model.embed_tokens": 0, "model.layers.0": "cpu", ...}`.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).context("a device map")?;
        let map = value.as_object().context("a device map is a JSON object")?;
        let mut entries = Vec::new();
        for (name, place) in map {
            let place = match place {
                serde_json::Value::Number(n) => n.to_string().parse()?,
                serde_json::Value::String(s) => s.parse()?,
                other => bail!("device map: `{name}` goes to {other}, not a device"),
            };
            entries.push((name.clone(), place));
        }
        Ok(Self(entries))
    }

    /// The places used: the GPUs in order, then the CPU, then the disk.
    pub fn places(&self) -> Vec<Place> {
        let used: std::collections::BTreeSet<Place> = self.0.iter().map(|(_, p)| *p).collect();
        used.into_iter().collect()
    }

    /// Accelerate's `clean_device_map`: a module whose parts all go to one place is
    /// written once, under its own name.
    fn clean(self, root: &Module) -> Self {
        fn walk(m: &Module, map: &[(String, Place)], out: &mut Vec<(String, Place)>) {
            let under: Vec<&(String, Place)> = map
                .iter()
                .filter(|(n, _)| {
                    m.name.is_empty() || n == &m.name || n.starts_with(&format!("{}.", m.name))
                })
                .collect();
            let first = under.first().map(|(_, p)| *p);
            if under.is_empty() {
                return;
            }
            if under.iter().all(|(_, p)| Some(*p) == first) {
                out.push((m.name.clone(), first.expect("not empty")));
                return;
            }
            for part in &m.parts {
                walk(part, map, out);
            }
        }
        let mut out = Vec::new();
        walk(root, &self.0, &mut out);
        Self(out)
    }
}

impl fmt::Display for DeviceMap {
    /// As Python prints Accelerate's `hf_device_map`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (name, place)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "'{name}': {place}")?;
        }
        f.write_str("}")
    }
}

/// Accelerate's `infer_auto_device_map` over `model` (the root, named `""`): the modules in
/// order, each on the first device with room — the GPUs in order, then the CPU, then the
/// disk. On the main devices (the first GPU and the CPU) room is kept for the largest layer
/// still to place, which an offloaded module needs there when it runs. A module too big for
/// the device at hand is split into its parts when it may be, else it starts the next
/// device. Tied modules go together.
pub fn infer_auto_device_map(model: &Module, max_memory: &MaxMemory) -> DeviceMap {
    let mut devices: Vec<Place> =
        max_memory.0.keys().copied().filter(|p| matches!(p, Place::Gpu(_))).collect();
    devices.push(Place::Cpu);
    devices.push(Place::Disk);
    let main: Vec<Place> = match devices.first() {
        Some(Place::Gpu(g)) => vec![Place::Gpu(*g), Place::Cpu],
        _ => vec![Place::Cpu],
    };
    let budget = |p: &Place| max_memory.0.get(p).copied();
    let mut queue: Vec<Module> = model.parts.clone();
    let (mut largest, mut largest_names) = Module::largest_layer(&queue);
    let mut used: BTreeMap<Place, u64> = BTreeMap::new();
    let mut current = 0;
    let mut map: Vec<(String, Place)> = Vec::new();
    while !queue.is_empty() {
        let module = queue.remove(0);
        largest_names.retain(|n| n != &module.name && !n.starts_with(&format!("{}.", module.name)));
        if largest_names.is_empty() {
            (largest, largest_names) = Module::largest_layer(&queue);
        }
        let device = devices[current];
        let mut room =
            if device == Place::Disk { None } else { Some(budget(&device).unwrap_or(0)) };
        if main.contains(&device) {
            room = room.map(|r| r.saturating_sub(largest));
        }
        // Tied modules still to place travel with this one.
        let tied: Vec<usize> = queue
            .iter()
            .enumerate()
            .filter(|(_, m)| module.tied_to.iter().any(|t| t == &m.name))
            .map(|(i, _)| i)
            .collect();
        let with_ties = module.bytes + tied.iter().map(|&i| queue[i].bytes).sum::<u64>();
        let here = used.get(&device).copied().unwrap_or(0);
        if room.is_none_or(|room| here + with_ties <= room) {
            *used.entry(device).or_default() += with_ties;
            map.push((module.name.clone(), device));
            for &i in tied.iter().rev() {
                let t = queue.remove(i);
                map.push((t.name, device));
            }
            continue;
        }
        if module.splittable() {
            let mut parts = module.parts.clone();
            parts.append(&mut queue);
            queue = parts;
            (largest, largest_names) = Module::largest_layer(&queue);
            continue;
        }
        // Too big and whole: the next device, starting with this module.
        queue.insert(0, module);
        current += 1;
    }
    DeviceMap(map).clean(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_accelerate_reads_them() {
        assert_eq!(parse_size("150MiB").unwrap(), 150 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("8Gb").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("1024").unwrap(), 1024);
        assert!(parse_size("two gigs").is_err());
        let m = MaxMemory::parse("0=2GiB,cpu=150MiB", 0).unwrap();
        assert_eq!(m.0[&Place::Gpu(0)], 2 << 30);
        assert_eq!(m.0[&Place::Cpu], 150 << 20);
        assert!(MaxMemory::parse("disk=1GiB", 0).is_err());
    }

    /// A model of an embedding, 4 layers and a head, each layer whole.
    fn model(embed: u64, layer: u64, head: u64) -> Module {
        let layers = (0..4)
            .map(|i| Module { whole: true, ..Module::leaf(format!("model.layers.{i}"), layer) })
            .collect::<Vec<_>>();
        let layer_list = Module { parts: layers, ..Module::leaf("model.layers", 4 * layer) };
        let inner = Module {
            parts: vec![
                Module::leaf("model.embed_tokens", embed),
                layer_list,
                Module::leaf("model.norm", 8),
            ],
            ..Module::leaf("model", embed + 4 * layer + 8)
        };
        Module {
            parts: vec![inner, Module::leaf("lm_head", head)],
            ..Module::leaf("", embed + 4 * layer + 8 + head)
        }
    }

    #[test]
    fn the_cpu_fills_in_order_keeping_room_for_the_largest_layer_then_the_disk() {
        let m = model(100, 30, 100);
        let everything = infer_auto_device_map(&m, &MaxMemory::parse("10000", 0).unwrap());
        assert_eq!(everything.to_string(), "{'': 'cpu'}");
        // 300 bytes, 100 kept for the largest layer: the embedding and 3 layers fit (190).
        let split = infer_auto_device_map(&m, &MaxMemory::parse("300", 0).unwrap());
        assert_eq!(
            split.to_string(),
            "{'model.embed_tokens': 'cpu', 'model.layers.0': 'cpu', 'model.layers.1': 'cpu', \
             'model.layers.2': 'cpu', 'model.layers.3': 'disk', 'model.norm': 'disk', \
             'lm_head': 'disk'}"
        );
        assert_eq!(split.place_of("model.layers.2.mlp.up_proj.weight"), Some(Place::Cpu));
        assert_eq!(split.place_of("lm_head.weight"), Some(Place::Disk));
        let json = r#"{"model.embed_tokens": 0, "model.layers": "cpu", "lm_head": "disk"}"#;
        let explicit = DeviceMap::from_json(json).unwrap();
        assert_eq!(explicit.place_of("model.layers.3.self_attn.q_proj.weight"), Some(Place::Cpu));
        assert_eq!(explicit.places(), [Place::Gpu(0), Place::Cpu, Place::Disk]);
    }
}
