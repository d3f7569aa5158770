//! `llama generate`: new tokens after a prompt, as transformers' `generate` makes them.
//!
//!     llama generate --model DIR --prompt-ids 1,2,3 --max-new-tokens N [--do-sample]
//!         [--temperature T] [--top-k K] [--top-p P] [--repetition-penalty R] [--seed S]
//!         [--precision bf16] [--attention sdpa|eager] [--lora-adapter ADIR]
//!         [--max-memory 150MiB | --device-map JSON] [--offload-folder DIR]
//!
//! Prints the new token ids, comma separated, on one line of standard output; on standard
//! error, the device map (with `--max-memory` or `--device-map`), the tokens per second
//! (prompt included), and a JSON line of this process's peak resident memory above its
//! baseline (libtorch loaded, no model) with the budget and the largest module. The
//! defaults are transformers', overlaid with the checkpoint's generation_config.json.

use std::path::PathBuf;

use accel_core::{Accelerator, Precision};
use accel_models::device_map::{DeviceMap, MaxMemory, infer_auto_device_map, parse_size};
use accel_models::llama::{Attention, GenerationConfig, Llama, LlamaConfig, modules};
use accel_models::lora::{self, LoraConfig, LoraInit};
use anyhow::{Context, Result, bail};
use clap::Parser;
use tch::Kind;

/// New tokens after a prompt.
#[derive(Debug, Parser)]
#[command(name = "llama generate")]
pub struct GenerateArgs {
    /// The checkpoint folder.
    #[arg(long)]
    model: PathBuf,
    /// The prompt's token ids, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    prompt_ids: Vec<i64>,
    /// Tokens to add at most.
    #[arg(long)]
    max_new_tokens: usize,
    /// Sample from the processed distribution (default: generation_config.json's
    /// `do_sample`, else greedy).
    #[arg(long, conflicts_with = "greedy")]
    do_sample: bool,
    /// Take the most likely token, whatever generation_config.json says.
    #[arg(long)]
    greedy: bool,
    #[arg(long)]
    temperature: Option<f64>,
    /// 0 keeps every token.
    #[arg(long)]
    top_k: Option<i64>,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long)]
    repetition_penalty: Option<f64>,
    /// Stop tokens, comma separated (default: the checkpoint's; empty: none).
    #[arg(long)]
    eos_ids: Option<String>,
    /// Seed of the sampling generator (`torch.manual_seed`).
    #[arg(long)]
    seed: Option<u64>,
    /// The weights' dtype: no (fp32) or bf16.
    #[arg(long, default_value = "no")]
    precision: Precision,
    #[arg(long, default_value = "sdpa")]
    attention: Attention,
    /// A PEFT adapter folder applied on top of the model.
    #[arg(long)]
    lora_adapter: Option<PathBuf>,
    /// Each step's processed scores, `scores` f32 [steps, vocab] (transformers'
    /// `output_scores`).
    #[arg(long)]
    scores_out: Option<PathBuf>,
    /// A memory budget: `150MiB` (the CPU's and each GPU's) or `0=2GiB,cpu=8GiB`; the model
    /// is then placed by Accelerate's automatic device map, what does not fit on the disk.
    #[arg(long, conflicts_with = "device_map")]
    max_memory: Option<String>,
    /// An explicit device map, JSON: `{"model.embed_tokens": "cpu", "model.layers": "disk",
    /// ...}`.
    #[arg(long)]
    device_map: Option<String>,
    /// Where modules placed on the disk are written when their dtype is not the
    /// checkpoint's.
    #[arg(long)]
    offload_folder: Option<PathBuf>,
    /// Print the device map and stop.
    #[arg(long)]
    print_map: bool,
}

impl GenerateArgs {
    /// The checkpoint's generation settings with the flags' on top.
    fn config(&self, model: &Llama) -> Result<GenerationConfig> {
        let mut config = GenerationConfig::for_model(model, &self.model)?;
        config.max_new_tokens = self.max_new_tokens;
        config.seed = self.seed;
        if self.do_sample || self.greedy {
            config.do_sample = self.do_sample;
        }
        if let Some(v) = self.temperature {
            config.temperature = v;
        }
        if let Some(v) = self.top_k {
            config.top_k = v;
        }
        if let Some(v) = self.top_p {
            config.top_p = v;
        }
        if let Some(v) = self.repetition_penalty {
            config.repetition_penalty = v;
        }
        if let Some(list) = &self.eos_ids {
            let ids = list.split(',').filter(|t| !t.trim().is_empty());
            config.eos_token_ids = ids
                .map(|t| t.trim().parse().with_context(|| format!("--eos-ids: `{t}`")))
                .collect::<Result<_>>()?;
        }
        Ok(config)
    }
}

/// `llama generate` with `args` (the words after `generate`).
pub fn run(args: impl IntoIterator<Item = String>) -> Result<()> {
    let args = GenerateArgs::parse_from(args);
    let acc = Accelerator::builder().cpu(true).build()?;
    if acc.num_processes() > 1 {
        bail!("llama generate runs in one process");
    }
    let kind = match args.precision {
        Precision::No => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
        other => bail!("--precision {other}: generation loads weights in fp32 (no) or bf16"),
    };
    let baseline = accel_examples::proc_status_bytes("VmRSS:")?;
    let mut vs = tch::nn::VarStore::new(acc.device());
    let map = match (&args.max_memory, &args.device_map) {
        (Some(budget), _) => {
            let config = LlamaConfig::read(&args.model)?;
            let budget = MaxMemory::parse(budget, tch::Cuda::device_count() as usize)?;
            Some(infer_auto_device_map(&modules(&config, kind), &budget))
        }
        (None, Some(json)) => Some(DeviceMap::from_json(json)?),
        (None, None) => None,
    };
    if let Some(map) = &map {
        eprintln!("llama generate: device map {map}");
        if args.print_map {
            return Ok(());
        }
    }
    let mut model = match &map {
        Some(map) => {
            Llama::dispatch(&acc, &vs, &args.model, map, args.offload_folder.as_deref(), kind)?
        }
        None => {
            let model = Llama::load_pretrained(&acc, &vs, &args.model)?;
            if kind == Kind::BFloat16 {
                vs.bfloat16();
            }
            model
        }
    };
    model.attention = args.attention;
    let adapters = tch::nn::VarStore::new(acc.device());
    if let Some(dir) = &args.lora_adapter {
        model.attach_lora(&adapters, &LoraConfig::read(dir)?, LoraInit::Uninit)?;
        lora::load_adapter(&adapters, dir)?;
    }
    let config = args.config(&model)?;
    let started = std::time::Instant::now();
    let out = model.generate(&args.prompt_ids, &config)?;
    let seconds = started.elapsed().as_secs_f64();
    let ids: Vec<String> = out.tokens.iter().map(i64::to_string).collect();
    println!("{}", ids.join(","));
    eprintln!(
        "llama generate: {} tokens in {seconds:.3} s ({:.1} tokens/s, prompt included), \
         key/value cache {} bytes",
        out.tokens.len(),
        out.tokens.len() as f64 / seconds,
        out.cache_bytes
    );
    let config = LlamaConfig::read(&args.model)?;
    let largest = modules(&config, kind).largest_whole().1;
    eprintln!(
        "{}",
        serde_json::json!({
            "peak_bytes": accel_examples::proc_status_bytes("VmHWM:")? - baseline,
            "budget_bytes": args.max_memory.as_deref().map(parse_size).transpose()?,
            "largest_module_bytes": largest,
        })
    );
    if let Some(path) = &args.scores_out {
        let scores = tch::Tensor::stack(&out.scores, 0);
        tch::Tensor::write_safetensors(&[("scores", &scores)], path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
