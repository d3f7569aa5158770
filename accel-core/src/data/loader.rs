//! A map-style data loader: a [`Dataset`] that builds batches from index lists, a sampler
//! (in order, or shuffled with a seed), sharding across ranks, and background threads that
//! prepare the next batches while the current one trains: one by default, or `num_workers`
//! building batches at once (torch's DataLoader workers), delivered in order.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, sync_channel};
use std::thread::JoinHandle;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use tch::Tensor;

use super::shard::{ShardOptions, shard_batches};
use crate::error::{Error, Result};

/// Data addressed by index. `batch` builds one batch from a list of indices, so a tensor
/// data set can gather rows with one `index_select` instead of stacking samples. Shared by
/// the loader's worker threads (`num_workers`), hence `Sync`.
pub trait Dataset: Send + Sync + 'static {
    /// What a batch is (a tensor, a tuple of tensors, a struct ...).
    type Batch: Send + 'static;
    /// Number of samples.
    fn len(&self) -> usize;
    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The batch made of samples `indices`.
    fn batch(&self, indices: &[usize]) -> Result<Self::Batch>;
}

/// Tensors sharing their first dimension; a batch is the selected rows of each.
#[derive(Debug)]
pub struct TensorDataset {
    tensors: Vec<Tensor>,
}

impl TensorDataset {
    /// Checks that every tensor has the same number of rows.
    pub fn new(tensors: Vec<Tensor>) -> Result<Self> {
        let rows: Vec<i64> =
            tensors.iter().map(|t| t.size().first().copied().unwrap_or(0)).collect();
        if tensors.is_empty() || rows.iter().any(|&r| r != rows[0]) {
            return Err(Error::Config(format!(
                "TensorDataset needs tensors with equal first dimensions, got {rows:?}"
            )));
        }
        Ok(Self { tensors })
    }
}

// SAFETY: the tensors are never changed after `new`; `batch` only reads them
// (`index_select` makes new tensors), and libtorch allows a tensor to be read from several
// threads at once (its reference count is atomic, autograd's metadata behind a mutex).
unsafe impl Sync for TensorDataset {}

impl Dataset for TensorDataset {
    type Batch = Vec<Tensor>;
    fn len(&self) -> usize {
        self.tensors[0].size()[0] as usize
    }
    fn batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        let index: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        let index = Tensor::from_slice(&index).to_device(self.tensors[0].device());
        Ok(self.tensors.iter().map(|t| t.f_index_select(0, &index)).collect::<Result<_, _>>()?)
    }
}

/// A data set of samples fetched one by one and combined by a collate function (the
/// shape of torch's map-style `Dataset` + `collate_fn`).
pub struct MapDataset<Item, Batch> {
    len: usize,
    get: Box<dyn Fn(usize) -> Result<Item> + Send + Sync>,
    collate: Box<dyn Fn(Vec<Item>) -> Result<Batch> + Send + Sync>,
}

impl<Item, Batch> std::fmt::Debug for MapDataset<Item, Batch> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MapDataset").field("len", &self.len).finish_non_exhaustive()
    }
}

impl<Item, Batch> MapDataset<Item, Batch> {
    /// `len` samples, sample `i` given by `get(i)`, batches made by `collate`.
    pub fn new(
        len: usize,
        get: impl Fn(usize) -> Result<Item> + Send + Sync + 'static,
        collate: impl Fn(Vec<Item>) -> Result<Batch> + Send + Sync + 'static,
    ) -> Self {
        Self { len, get: Box::new(get), collate: Box::new(collate) }
    }
}

impl<Item: 'static, Batch: Send + 'static> Dataset for MapDataset<Item, Batch> {
    type Batch = Batch;
    fn len(&self) -> usize {
        self.len
    }
    fn batch(&self, indices: &[usize]) -> Result<Batch> {
        let items = indices.iter().map(|&i| (self.get)(i)).collect::<Result<Vec<_>>>()?;
        (self.collate)(items)
    }
}

/// Stacks tensors along a new first dimension: the usual collate function.
pub fn stack(items: Vec<Tensor>) -> Result<Tensor> {
    Ok(Tensor::f_stack(&items, 0)?)
}

/// The order samples are visited in.
#[derive(Clone)]
pub enum Sampler {
    /// 0, 1, 2, ...
    Sequential,
    /// A permutation drawn from ChaCha8 seeded with `seed`, on stream `epoch`: the same on
    /// every rank and every run, different each epoch.
    Shuffled {
        /// The seed.
        seed: u64,
    },
    /// Any order: `(epoch, len) -> indices`.
    Custom(Arc<dyn Fn(u64, usize) -> Vec<usize> + Send + Sync>),
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sampler::Sequential => f.write_str("Sequential"),
            Sampler::Shuffled { seed } => write!(f, "Shuffled {{ seed: {seed} }}"),
            Sampler::Custom(_) => f.write_str("Custom"),
        }
    }
}

impl Sampler {
    /// The indices of epoch `epoch` for a data set of `len` samples.
    pub fn indices(&self, epoch: u64, len: usize) -> Vec<usize> {
        match self {
            Sampler::Sequential => (0..len).collect(),
            Sampler::Shuffled { seed } => {
                let mut rng = ChaCha8Rng::seed_from_u64(*seed);
                rng.set_stream(epoch);
                let mut order: Vec<usize> = (0..len).collect();
                order.shuffle(&mut rng);
                order
            }
            Sampler::Custom(f) => f(epoch, len),
        }
    }
}

/// Settings of a [`DataLoader`].
#[derive(Debug, Clone)]
pub struct LoaderOptions {
    /// Samples per batch (per process, unless `split_batches`).
    pub batch_size: usize,
    /// Sample order.
    pub sampler: Sampler,
    /// Drop an incomplete last batch.
    pub drop_last: bool,
    /// Batches prepared ahead by each background thread (0: build batches on the caller's
    /// thread; torch's `prefetch_factor`).
    pub prefetch: usize,
    /// Threads building batches at once (torch's `num_workers`), each taking every
    /// `num_workers`-th batch; the batches still arrive in order. 0 or 1: one background
    /// thread (with `prefetch` > 0). For data sets whose batches take time to build (decoding,
    /// augmentation).
    pub num_workers: usize,
    /// Build batches in page-locked (pinned) host memory when the accelerator's device is
    /// CUDA, so that their copies to the GPU are asynchronous (torch's `pin_memory`; on by
    /// default here, as it costs nothing elsewhere). Done by the worker threads, so only
    /// with `prefetch` > 0.
    pub pin_memory: bool,
    /// See [`ShardOptions::even_batches`].
    pub even_batches: bool,
    /// See [`ShardOptions::split_batches`].
    pub split_batches: bool,
}

impl Default for LoaderOptions {
    fn default() -> Self {
        Self {
            batch_size: 1,
            sampler: Sampler::Sequential,
            drop_last: false,
            prefetch: 2,
            num_workers: 0,
            pin_memory: true,
            even_batches: true,
            split_batches: false,
        }
    }
}

/// What the workers do to each batch they built before handing it over (pinning it).
pub(crate) type Finish<B> = Arc<dyn Fn(B) -> B + Send + Sync>;

/// Batches of a [`Dataset`], one epoch per [`DataLoader::iter`] call.
pub struct DataLoader<D: Dataset> {
    dataset: Option<D>,
    options: LoaderOptions,
    finish: Option<Finish<D::Batch>>,
    rank: usize,
    world: usize,
    epoch: u64,
    skip: usize,
}

impl<D: Dataset> std::fmt::Debug for DataLoader<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("options", &self.options)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

impl<D: Dataset> DataLoader<D> {
    /// A loader over `dataset` for a single process.
    pub fn new(dataset: D, options: LoaderOptions) -> Result<Self> {
        if options.batch_size == 0 {
            return Err(Error::Config("DataLoader batch_size must be >= 1".into()));
        }
        Ok(Self {
            dataset: Some(dataset),
            options,
            finish: None,
            rank: 0,
            world: 1,
            epoch: 0,
            skip: 0,
        })
    }

    /// Makes the worker threads pass each batch through `finish` (the accelerator pins
    /// batches bound for a GPU).
    pub(crate) fn pin_batches(&mut self, finish: Finish<D::Batch>) {
        self.finish = Some(finish);
    }

    /// The samples of each batch one process gets (after [`DataLoader::shard`]: a split
    /// batch's share).
    pub fn per_process_batch(&self) -> usize {
        if self.options.split_batches {
            self.options.batch_size / self.world.max(1)
        } else {
            self.options.batch_size
        }
    }

    /// Shard batches across `world` processes as Accelerate does (the accelerator calls this).
    pub fn shard(&mut self, rank: usize, world: usize) -> Result<()> {
        if self.options.split_batches && self.options.batch_size % world != 0 {
            return Err(Error::Config(format!(
                "split_batches needs a batch size divisible by the {world} processes; got {}",
                self.options.batch_size
            )));
        }
        (self.rank, self.world) = (rank, world);
        Ok(())
    }

    /// The epoch the next [`iter`](Self::iter) runs.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Makes the next [`iter`](Self::iter) run epoch `epoch` (e.g. when resuming).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// Skips the first `n` batches of the next epoch without building them (resume).
    pub fn skip_first_batches(&mut self, n: usize) {
        self.skip = n;
    }

    /// The options.
    pub fn options(&self) -> &LoaderOptions {
        &self.options
    }

    /// The index lists of this rank's batches in `epoch`.
    pub fn batch_indices(&self, epoch: u64) -> Vec<Vec<usize>> {
        let len = self.dataset.as_ref().map_or(0, Dataset::len);
        let order = self.options.sampler.indices(epoch, len);
        let bs = self.options.batch_size;
        let batches: Vec<Vec<usize>> = order
            .chunks(bs)
            .filter(|c| !self.options.drop_last || c.len() == bs)
            .map(<[usize]>::to_vec)
            .collect();
        shard_batches(
            &batches,
            ShardOptions {
                rank: self.rank,
                world: self.world,
                batch_size: bs,
                drop_last: self.options.drop_last,
                even_batches: self.options.even_batches,
                split_batches: self.options.split_batches,
            },
        )
    }

    /// Real samples in the last round across all ranks (the rest is padding), if the last
    /// round is padded: `len % (batch × world)` (`len % batch` with split batches).
    pub fn remainder(&self) -> Option<usize> {
        let len = self.dataset.as_ref().map_or(0, Dataset::len);
        let total = if self.options.split_batches {
            self.options.batch_size
        } else {
            self.options.batch_size * self.world
        };
        let remainder = len % total;
        (!self.options.drop_last && self.options.even_batches && remainder > 0).then_some(remainder)
    }

    /// Batches per epoch on this rank.
    pub fn len(&self) -> usize {
        self.batch_indices(self.epoch).len()
    }

    /// Whether an epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The batches of the current epoch (then the epoch counter advances).
    pub fn iter(&mut self) -> Batches<'_, D> {
        let epoch = self.epoch;
        let mut plan = self.batch_indices(epoch);
        let skip = std::mem::take(&mut self.skip).min(plan.len());
        plan.drain(..skip);
        self.epoch += 1;
        let dataset = self.dataset.take().expect("a DataLoader epoch is already running");
        let source = if self.options.prefetch == 0 {
            Source::Inline { dataset: Some(dataset), plan: plan.into_iter() }
        } else {
            // Worker w builds batches w, w + n, w + 2n, ... into its own queue; the
            // iterator takes from the queues in turn, so the order is the plan's.
            let workers = self.options.num_workers.max(1);
            let dataset = Arc::new(dataset);
            let mut queues = Vec::with_capacity(workers);
            let mut handles = Vec::with_capacity(workers);
            for w in 0..workers {
                let (tx, rx) = sync_channel(self.options.prefetch);
                let mine: Vec<Vec<usize>> = plan.iter().skip(w).step_by(workers).cloned().collect();
                let dataset = dataset.clone();
                let finish = self.finish.clone();
                let handle = std::thread::Builder::new()
                    .name(format!("accel-data-{w}"))
                    .spawn(move || {
                        for indices in mine {
                            let batch = dataset.batch(&indices).map(|b| match &finish {
                                Some(finish) => finish(b),
                                None => b,
                            });
                            let failed = batch.is_err();
                            if tx.send(batch).is_err() || failed {
                                break;
                            }
                        }
                    })
                    .expect("cannot spawn a data loader worker thread");
                queues.push(rx);
                handles.push(handle);
            }
            Source::Prefetch { queues, handles, dataset: Some(dataset), next: 0 }
        };
        Batches { loader: self, source, epoch, position: skip }
    }
}

enum Source<D: Dataset> {
    Inline {
        dataset: Option<D>,
        plan: std::vec::IntoIter<Vec<usize>>,
    },
    /// Worker threads, one queue each, taken from in turn (`next`: whose batch comes next).
    Prefetch {
        queues: Vec<Receiver<Result<D::Batch>>>,
        handles: Vec<JoinHandle<()>>,
        dataset: Option<Arc<D>>,
        next: usize,
    },
}

/// One epoch of batches; gives the data set back to its loader when dropped.
pub struct Batches<'a, D: Dataset> {
    loader: &'a mut DataLoader<D>,
    source: Source<D>,
    epoch: u64,
    position: usize,
}

impl<D: Dataset> Batches<'_, D> {
    /// The epoch being iterated.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// Batches yielded so far in this epoch (skipped ones included).
    pub fn position(&self) -> usize {
        self.position
    }
}

impl<D: Dataset> Iterator for Batches<'_, D> {
    type Item = Result<D::Batch>;
    fn next(&mut self) -> Option<Self::Item> {
        let item = match &mut self.source {
            Source::Inline { dataset, plan } => {
                let indices = plan.next()?;
                dataset.as_ref().map(|d| d.batch(&indices))
            }
            Source::Prefetch { queues, next, .. } => {
                let item = queues[*next].recv().ok();
                *next = (*next + 1) % queues.len();
                item
            }
        };
        if item.is_some() {
            self.position += 1;
        }
        item
    }
}

impl<D: Dataset> Drop for Batches<'_, D> {
    fn drop(&mut self) {
        let dataset = match &mut self.source {
            Source::Inline { dataset, .. } => dataset.take(),
            Source::Prefetch { queues, handles, dataset, .. } => {
                // Unblock the workers (their next send fails), then take the data set back.
                queues.clear();
                for handle in handles.drain(..) {
                    let _ = handle.join();
                }
                dataset.take().and_then(|d| Arc::try_unwrap(d).ok())
            }
        };
        self.loader.dataset = dataset;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tch::{Device, Kind};

    use super::*;
    use crate::ToDevice;

    /// 40 samples, each a row of two values and a label.
    fn dataset() -> MapDataset<(Tensor, Tensor), (Tensor, Tensor)> {
        MapDataset::new(
            40,
            |i| {
                let i = i as f32;
                Ok((Tensor::from_slice(&[i, -i]), Tensor::from_slice(&[i as i64 % 3])))
            },
            |items| {
                let (x, y): (Vec<_>, Vec<_>) = items.into_iter().unzip();
                Ok((Tensor::f_stack(&x, 0)?, Tensor::f_cat(&y, 0)?))
            },
        )
    }

    fn values(batches: impl Iterator<Item = Result<(Tensor, Tensor)>>) -> Vec<Vec<f32>> {
        batches
            .map(|b| {
                let (x, y) = b.unwrap();
                let x = Vec::<f32>::try_from(x.to_device(Device::Cpu).view([-1])).unwrap();
                let y = Vec::<i64>::try_from(y.to_device(Device::Cpu)).unwrap();
                x.into_iter().chain(y.into_iter().map(|v| v as f32)).collect()
            })
            .collect()
    }

    fn options(num_workers: usize) -> LoaderOptions {
        LoaderOptions {
            batch_size: 4,
            sampler: Sampler::Shuffled { seed: 3 },
            num_workers,
            ..Default::default()
        }
    }

    /// The accelerator's pinning step runs on the worker threads, once per batch, and the
    /// batches (order and values) are those of a loader without workers.
    #[test]
    fn workers_finish_every_batch_on_their_threads_in_the_plans_order() {
        let plain = values(DataLoader::new(dataset(), options(0)).unwrap().iter());
        for workers in [1, 4] {
            let mut loader = DataLoader::new(dataset(), options(workers)).unwrap();
            let threads = Arc::new(Mutex::new(Vec::new()));
            let seen = threads.clone();
            loader.pin_batches(Arc::new(move |batch| {
                let name = std::thread::current().name().unwrap_or("?").to_owned();
                seen.lock().unwrap().push(name);
                batch
            }));
            assert_eq!(values(loader.iter()), plain, "{workers} workers");
            let threads = threads.lock().unwrap();
            assert_eq!(threads.len(), 10, "each of the 10 batches finished once");
            assert!(threads.iter().all(|t| t.starts_with("accel-data-")), "{threads:?}");
        }
    }

    /// On a GPU: batches built by 4 workers in pinned memory, moved to the device by a
    /// prepared loader (asynchronous copies on the compute stream), equal the batches of a
    /// loader without workers. Without one: pinning leaves CPU-bound batches as they are.
    #[test]
    fn pinned_batches_reach_the_gpu_in_order_and_unchanged_cuda() {
        crate::cuda::load_libtorch_cuda();
        let t = Tensor::arange(6, (Kind::Float, Device::Cpu));
        let kept = t.shallow_clone().pin_memory(Device::Cpu);
        assert_eq!(kept.data_ptr(), t.data_ptr(), "not bound for a GPU: not copied");
        assert!(!crate::shim::is_pinned(&t).unwrap(), "pageable memory, GPU or not");
        if !tch::Cuda::is_available() {
            // Without a GPU there is no pinned memory: an error, which pin_memory absorbs.
            let e = crate::shim::pin_memory(&t).unwrap_err().to_string();
            assert!(e.starts_with("libtorch (pin_memory): "), "{e}");
            let kept = t.shallow_clone().pin_memory(Device::Cuda(0));
            assert_eq!(kept.data_ptr(), t.data_ptr(), "kept as it is");
            return;
        }
        let gpu = Device::Cuda(0);
        let pinned = t.shallow_clone().pin_memory(gpu);
        let is_pinned = |t: &Tensor| crate::shim::is_pinned(t).unwrap();
        assert!(is_pinned(&pinned) && !is_pinned(&t));
        let on_gpu = pinned.to_device(gpu);
        assert_eq!(on_gpu.device(), gpu);
        assert!(on_gpu.to_device(Device::Cpu).equal(&t));
        // The workers pin (x, y) pairs field by field.
        let mut loader = DataLoader::new(dataset(), options(4)).unwrap();
        loader.pin_batches(Arc::new(move |b: (Tensor, Tensor)| b.pin_memory(gpu)));
        for batch in loader.iter() {
            let (x, y) = batch.unwrap();
            assert!(is_pinned(&x) && is_pinned(&y));
        }
        let plain = values(DataLoader::new(dataset(), options(0)).unwrap().iter());
        let accelerator = crate::Accelerator::builder().build().unwrap();
        assert_eq!(accelerator.device(), gpu);
        let mut prepared =
            accelerator.prepare_loader(DataLoader::new(dataset(), options(4)).unwrap()).unwrap();
        let batches: Vec<_> = prepared.iter().collect();
        assert!(batches.iter().all(|b| b.as_ref().unwrap().0.device() == gpu));
        assert_eq!(values(batches.into_iter()), plain);
    }
}
