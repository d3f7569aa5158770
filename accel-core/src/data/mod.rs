//! Data: a map-style [`DataLoader`] over a [`Dataset`], and Accelerate's sharding rules.

mod loader;
mod shard;

pub use loader::{
    Batches, DataLoader, Dataset, LoaderOptions, MapDataset, Sampler, TensorDataset, stack,
};
pub use shard::{IterableShard, ShardOptions, shard_batches};
