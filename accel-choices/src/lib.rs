//! The named choices of accel's configuration: [`Strategy`], [`Precision`], fp8's
//! [`Fp8Recipe`], FSDP's [`Sharding`], [`DataSharding`] and the trackers
//! ([`LogWith`]); and the table of every setting ([`settings!`], [`SETTINGS`]). One
//! definition serves the runtime (accel-core re-exports these and generates its
//! configuration from the table) and the `#[accelerate]` attribute (accel-macros parses its
//! arguments with them), so the attribute accepts exactly what the runtime runs.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

mod settings;
pub use settings::{
    BadValue, Literal, SETTINGS, Setting, SettingValue, StateDict, Wrap, parse_bool, setting,
};

/// A name that is none of the valid choices, with the nearest one if it looks like a typo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownChoice {
    /// What was being chosen, e.g. `strategy`.
    pub what: &'static str,
    /// Its plural, e.g. `strategies`.
    pub plural: &'static str,
    /// What was written.
    pub got: String,
    /// Every valid name.
    pub valid: &'static [&'static str],
}

impl fmt::Display for UnknownChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = self.valid.iter().map(|v| format!("`{v}`")).collect::<Vec<_>>().join(", ");
        write!(f, "unknown {} `{}`; the {} are {list}", self.what, self.got, self.plural)?;
        if let Some(best) = closest(&self.got, self.valid) {
            write!(f, " — did you mean `{best}`?")?;
        }
        Ok(())
    }
}

impl std::error::Error for UnknownChoice {}

/// The valid choice nearest to `got`, if any is near enough to be a typo.
pub fn closest<'a>(got: &str, valid: &[&'a str]) -> Option<&'a str> {
    valid
        .iter()
        .map(|v| (strsim::jaro_winkler(got, v), *v))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, v)| v)
}

macro_rules! choices {
    (
        $(#[$doc:meta])* $ty:ident, $what:literal, $plural:literal,
        $($(#[$vdoc:meta])* $name:literal => $variant:ident),+ $(,)?
    ) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $ty {
            $($(#[$vdoc])* #[serde(rename = $name)] $variant),+
        }

        impl $ty {
            /// Every valid spelling, for messages.
            pub const NAMES: &'static [&'static str] = &[$($name),+];
            /// Every choice, in the order of [`Self::NAMES`].
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The canonical lowercase name.
            pub fn as_str(self) -> &'static str {
                match self { $($ty::$variant => $name),+ }
            }

            /// The Rust name of the variant (what generated code writes).
            pub fn variant_name(self) -> &'static str {
                match self { $($ty::$variant => stringify!($variant)),+ }
            }
        }

        impl FromStr for $ty {
            type Err = UnknownChoice;
            fn from_str(s: &str) -> Result<Self, UnknownChoice> {
                match s.to_ascii_lowercase().as_str() {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(UnknownChoice {
                        what: $what,
                        plural: $plural,
                        got: s.to_owned(),
                        valid: Self::NAMES,
                    }),
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

choices!(
    /// How the work is split across processes.
    Strategy, "strategy", "strategies",
    /// One process, no distribution (Accelerate's `NO`).
    "single" => Single,
    /// Data parallel: replicated parameters, averaged gradients.
    "ddp" => Ddp,
    /// ZeRO stage 1: optimizer state sharded.
    "zero1" => Zero1,
    /// ZeRO stage 2: optimizer state and gradients sharded.
    "zero2" => Zero2,
    /// ZeRO stage 3: optimizer state, gradients and parameters sharded.
    "zero3" => Zero3,
    /// FSDP, with a sharding strategy (full_shard = zero3 by default).
    "fsdp" => Fsdp,
    /// FSDP's `HYBRID_SHARD`: zero3 among the processes of each machine, replicated across
    /// machines (a replicate × shard mesh).
    "hybrid_shard" => HybridShard,
    /// Chosen when the model is prepared: the lightest of ddp, zero1, zero2, zero3 (then
    /// zero3 with offload) whose model state fits this process's memory.
    "auto" => Auto,
);

choices!(
    /// Arithmetic precision of the forward and backward passes (master weights stay fp32).
    Precision, "precision", "precisions",
    /// fp32 throughout.
    "no" => No,
    /// fp16 autocast with dynamic loss scaling.
    "fp16" => Fp16,
    /// bf16 autocast, no scaling.
    "bf16" => Bf16,
    /// fp8 matmuls in the linear layers (torchao's recipes; fast on Ada/Hopper GPUs,
    /// emulated on CPU), the rest under bf16.
    "fp8" => Fp8,
);

choices!(
    /// How fp8 layers choose their scales (torchao's `Float8LinearRecipeName`).
    Fp8Recipe, "fp8 recipe", "fp8 recipes",
    /// One scale per tensor, computed from its current amax; inputs and weights in e4m3,
    /// output gradients in e5m2 (torchao's default).
    "tensorwise" => Tensorwise,
    /// One scale per row (per column for the right-hand operand), rounded down to a power
    /// of two; e4m3 throughout.
    "rowwise" => Rowwise,
);

choices!(
    /// FSDP's sharding strategies (`strategy = "fsdp", sharding = ..`).
    Sharding, "sharding strategy", "sharding strategies",
    /// Parameters, gradients and optimizer state sharded (ZeRO-3).
    "full_shard" => FullShard,
    /// Gradients and optimizer state sharded (ZeRO-2).
    "shard_grad_op" => ShardGradOp,
    /// Nothing sharded (DDP).
    "no_shard" => NoShard,
    /// Full sharding within each machine, replicas across machines.
    "hybrid_shard" => HybridShard,
);

choices!(
    /// Where each process's batches come from (`#[accelerate(data = ..)]`).
    DataSharding, "data sharding", "data shardings",
    /// The accelerator deals the batches: the attribute prepares the iterable of each
    /// training loop, and with several processes a step on batches that did not come
    /// through a prepared iterator or loader is an error. A loop that only counts
    /// (`for iter in 0..max_iters` drawing its own batches) runs every iteration on every
    /// process, each drawing from its own random stream; where the attribute cannot tell
    /// which of the two a loop is, it asks for `dealt` or `drawn`.
    "prepared" => Prepared,
    /// The index of the training loop's range picks each batch (`get_batch(i)`): the range
    /// is dealt, as for `prepared`, even where the attribute cannot see that it picks data.
    "dealt" => Dealt,
    /// The training loop draws its own batches (nanoGPT's `get_batch`): every process runs
    /// every iteration, drawing from torch's generator seeded with the seed + its rank.
    "drawn" => Drawn,
    /// The program gives each process its own part of the data itself: nothing is dealt
    /// and nothing checks it (autocast and accumulation still apply).
    "manual" => Manual,
);

choices!(
    /// An experiment tracker (`log_with`): where `init_trackers` and `log` send a run's
    /// hyperparameters and values.
    LogWith, "tracker", "trackers",
    /// TensorBoard event files.
    "tensorboard" => TensorBoard,
    /// `metrics.jsonl`, `metrics.csv` and `hparams.json`.
    "jsonl" => Jsonl,
    /// An MLflow tracking server, over its REST API (`MLFLOW_TRACKING_URI`).
    "mlflow" => MlFlow,
    /// Weights & Biases, as an offline run (`wandb/offline-run-*`) for `wandb sync`.
    "wandb" => Wandb,
    /// Every one of them.
    "all" => All,
);

impl LogWith {
    /// Parses a comma-separated list (`"tensorboard,mlflow"`); empty parts are skipped.
    pub fn parse_list(text: &str) -> Result<Vec<LogWith>, UnknownChoice> {
        text.split(',').map(str::trim).filter(|p| !p.is_empty()).map(str::parse).collect()
    }
}

// Written out: the enums come from a macro shared with `Sharding`, which has no default.
#[allow(clippy::derivable_impls)]
impl Default for Strategy {
    fn default() -> Self {
        Strategy::Single
    }
}

#[allow(clippy::derivable_impls)]
impl Default for DataSharding {
    fn default() -> Self {
        DataSharding::Prepared
    }
}

#[allow(clippy::derivable_impls)]
impl Default for Fp8Recipe {
    fn default() -> Self {
        Fp8Recipe::Tensorwise
    }
}

#[allow(clippy::derivable_impls)]
impl Default for Precision {
    fn default() -> Self {
        Precision::No
    }
}

impl Sharding {
    /// The strategy FSDP with this sharding is.
    pub fn strategy(self) -> Strategy {
        match self {
            Sharding::FullShard => Strategy::Zero3,
            Sharding::ShardGradOp => Strategy::Zero2,
            Sharding::NoShard => Strategy::Ddp,
            Sharding::HybridShard => Strategy::HybridShard,
        }
    }
}

impl Strategy {
    /// Whether parameters or gradients are sharded (what `offload` needs).
    pub fn shards(self) -> bool {
        matches!(self, Strategy::Zero2 | Strategy::Zero3 | Strategy::Fsdp | Strategy::HybridShard)
    }

    /// Whether `offload` can go with it (a sharded strategy, or auto, which then shards).
    pub fn can_offload(self) -> bool {
        self.shards() || self == Strategy::Auto
    }

    /// The strategies `offload` goes with, for messages: `"zero2", "zero3", "fsdp",
    /// "hybrid_shard" or "auto"` (the attribute's check and the run-time one name the same).
    pub fn offload_choices() -> String {
        let names: Vec<String> =
            Strategy::ALL.iter().filter(|s| s.can_offload()).map(|s| format!("\"{s}\"")).collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.concat(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offload_names_every_strategy_it_goes_with() {
        let named = Strategy::offload_choices();
        for s in Strategy::ALL {
            assert_eq!(named.contains(&format!("\"{s}\"")), s.can_offload(), "{s}: {named}");
        }
        assert!(named.ends_with(" or \"auto\""), "{named}");
    }

    #[test]
    fn names_parse_back_and_typos_get_a_guess() {
        for s in Strategy::ALL {
            assert_eq!(s.as_str().parse::<Strategy>(), Ok(*s));
        }
        assert_eq!("DDP".parse::<Strategy>(), Ok(Strategy::Ddp));
        let err = "fdsp".parse::<Strategy>().unwrap_err().to_string();
        assert!(err.contains("did you mean `fsdp`"), "{err}");
        let err = "bf61".parse::<Precision>().unwrap_err().to_string();
        assert!(err.contains("`no`, `fp16`, `bf16`, `fp8`") && err.contains("`bf16`?"), "{err}");
        assert_eq!(Sharding::ShardGradOp.strategy(), Strategy::Zero2);
        assert_eq!(
            LogWith::parse_list(" TensorBoard, mlflow,"),
            Ok(vec![LogWith::TensorBoard, LogWith::MlFlow])
        );
        let err = LogWith::parse_list("jsonl,mlfow").unwrap_err().to_string();
        assert!(err.contains("unknown tracker `mlfow`") && err.contains("`mlflow`?"), "{err}");
    }
}
