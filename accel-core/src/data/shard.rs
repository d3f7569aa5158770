//! Which batches a rank takes: Accelerate's `BatchSamplerShard`, line for line.
//!
//! Batch k of the underlying order goes to rank k mod N. With `even_batches` the last round
//! is completed by cycling indices from the start of the epoch, so every rank gets the
//! same number of full batches; `split_batches` instead cuts every batch into N slices.

/// How to shard; `world == 1` returns the batches unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardOptions {
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub world: usize,
    /// Full batch size of the underlying batches.
    pub batch_size: usize,
    /// The underlying sampler drops an incomplete last batch.
    pub drop_last: bool,
    /// Pad the last round so that all ranks get equally many batches (Accelerate's default).
    pub even_batches: bool,
    /// Cut each batch into `world` slices instead of dealing whole batches.
    pub split_batches: bool,
}

/// The batches (lists of sample indices) that `options.rank` processes, in order.
pub fn shard_batches(batches: &[Vec<usize>], options: ShardOptions) -> Vec<Vec<usize>> {
    if options.world <= 1 {
        return batches.to_vec();
    }
    if options.split_batches { split(batches, options) } else { deal(batches, options) }
}

fn deal(batches: &[Vec<usize>], o: ShardOptions) -> Vec<Vec<usize>> {
    let (n, rank, bs) = (o.world, o.rank, o.batch_size);
    let mut out = Vec::new();
    let mut initial: Vec<usize> = Vec::new();
    let mut to_yield: Vec<usize> = Vec::new();
    let mut idx = 0;
    let mut last: Vec<usize> = Vec::new();
    for (i, batch) in batches.iter().enumerate() {
        idx = i;
        if !o.drop_last && i < n {
            initial.extend(batch);
        }
        if i % n == rank {
            to_yield = batch.clone();
        }
        if i % n == n - 1 && batch.len() == bs {
            out.push(std::mem::take(&mut to_yield));
        }
        last = batch.clone();
    }
    if o.drop_last || initial.is_empty() {
        return out;
    }
    if !o.even_batches {
        if !to_yield.is_empty() {
            out.push(to_yield);
        }
        return out;
    }
    if to_yield.len() == bs {
        out.push(to_yield);
    }
    while initial.len() < n * bs {
        initial.extend(initial.clone());
    }
    let mut batch = last;
    if batch.len() == bs {
        batch.clear();
        idx += 1;
    }
    let mut cycle = 0;
    while idx % n != 0 || !batch.is_empty() {
        let end = cycle + bs - batch.len();
        batch.extend(&initial[cycle..end]);
        if idx % n == rank {
            out.push(batch.clone());
        }
        cycle = end;
        batch.clear();
        idx += 1;
    }
    out
}

fn split(batches: &[Vec<usize>], o: ShardOptions) -> Vec<Vec<usize>> {
    let (n, rank, bs) = (o.world, o.rank, o.batch_size);
    let len = bs / n;
    let slice =
        |b: &[usize]| b[(len * rank).min(b.len())..(len * (rank + 1)).min(b.len())].to_vec();
    let mut out: Vec<Vec<usize>> =
        batches.iter().filter(|b| b.len() == bs).map(|b| slice(b)).collect();
    let (Some(first), Some(last)) = (batches.first(), batches.last()) else { return out };
    if o.drop_last || last.len() >= bs {
        return out;
    }
    if !o.even_batches {
        if last.len() > len * rank {
            out.push(slice(last));
        }
        return out;
    }
    let mut initial = first.clone();
    while initial.len() < bs {
        initial.extend(initial.clone());
    }
    let mut padded = last.clone();
    padded.extend(initial);
    out.push(slice(&padded));
    out
}

/// Accelerate's `IterableDatasetShard` for data that comes as a stream of samples: samples
/// are read in buffers of `batch_size × world` (or `batch_size` with `split_batches`), and
/// rank r takes its slice of each buffer; a short last buffer is completed with samples
/// from the first one (unless `drop_last`), so every rank sees as many samples.
#[derive(Debug)]
pub struct IterableShard<I: Iterator> {
    inner: I,
    options: ShardOptions,
    first: Option<Vec<I::Item>>,
    ready: std::collections::VecDeque<I::Item>,
    done: bool,
}

impl<I: Iterator> IterableShard<I>
where
    I::Item: Clone,
{
    /// This rank's samples of `inner`.
    pub fn new(inner: I, options: ShardOptions) -> Self {
        Self { inner, options, first: None, ready: Default::default(), done: false }
    }

    fn sizes(&self) -> (usize, std::ops::Range<usize>) {
        let o = self.options;
        let world = o.world.max(1);
        let (real, per_process) = if o.split_batches {
            (o.batch_size, o.batch_size / world)
        } else {
            (o.batch_size * world, o.batch_size)
        };
        (real, o.rank * per_process..(o.rank + 1) * per_process)
    }
}

impl<I: Iterator> Iterator for IterableShard<I>
where
    I::Item: Clone,
{
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        while self.ready.is_empty() && !self.done {
            let (real, slice) = self.sizes();
            let mut buffer: Vec<I::Item> = self.inner.by_ref().take(real).collect();
            if buffer.len() == real {
                if self.first.is_none() {
                    self.first = Some(buffer.clone());
                }
            } else {
                self.done = true;
                if buffer.is_empty() || self.options.drop_last {
                    break;
                }
                let first = self.first.get_or_insert_with(|| buffer.clone()).clone();
                while buffer.len() < real {
                    buffer.extend(first.iter().cloned());
                }
            }
            self.ready.extend(buffer.into_iter().skip(slice.start).take(slice.len()));
        }
        self.ready.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batches(n: usize, bs: usize, drop_last: bool) -> Vec<Vec<usize>> {
        let all: Vec<usize> = (0..n).collect();
        all.chunks(bs).filter(|c| !drop_last || c.len() == bs).map(<[usize]>::to_vec).collect()
    }

    fn opts(rank: usize, world: usize, bs: usize) -> ShardOptions {
        ShardOptions {
            rank,
            world,
            batch_size: bs,
            drop_last: false,
            even_batches: true,
            split_batches: false,
        }
    }

    #[test]
    fn even_batches_cycle_from_the_start_reference_oracle() {
        let b = batches(22, 3, false);
        assert_eq!(
            shard_batches(&b, opts(0, 2, 3)),
            vec![vec![0, 1, 2], vec![6, 7, 8], vec![12, 13, 14], vec![18, 19, 20]]
        );
        assert_eq!(
            shard_batches(&b, opts(1, 2, 3)),
            vec![vec![3, 4, 5], vec![9, 10, 11], vec![15, 16, 17], vec![21, 0, 1]]
        );
    }

    #[test]
    fn drop_last_gives_three_batches_per_rank() {
        let b = batches(21, 3, true);
        for rank in 0..2 {
            let o = ShardOptions { drop_last: true, ..opts(rank, 2, 3) };
            assert_eq!(shard_batches(&b, o).len(), 3);
        }
    }

    #[test]
    fn uneven_batches_are_not_padded() {
        let b = batches(7, 2, false);
        let sizes = |rank| {
            let o = ShardOptions { even_batches: false, ..opts(rank, 2, 2) };
            shard_batches(&b, o).iter().map(Vec::len).collect::<Vec<_>>()
        };
        assert_eq!(sizes(0), [2, 2]);
        assert_eq!(sizes(1), [2, 1]);
    }

    #[test]
    fn split_batches_cut_each_batch() {
        let b = batches(10, 4, false);
        let o = |rank| ShardOptions { split_batches: true, ..opts(rank, 2, 4) };
        assert_eq!(shard_batches(&b, o(0)), vec![vec![0, 1], vec![4, 5], vec![8, 9]]);
        assert_eq!(shard_batches(&b, o(1)), vec![vec![2, 3], vec![6, 7], vec![0, 1]]);
    }

    #[test]
    fn every_rank_gets_the_same_count_and_all_samples_are_seen() {
        for (n, bs, world) in [(22, 3, 2), (82, 16, 2), (10, 4, 3), (5, 4, 3), (1, 2, 4)] {
            let b = batches(n, bs, false);
            let shards: Vec<_> =
                (0..world).map(|r| shard_batches(&b, opts(r, world, bs))).collect();
            assert!(shards.iter().all(|s| s.len() == shards[0].len()), "{n} {bs} {world}");
            let mut seen: Vec<usize> = shards.iter().flatten().flatten().copied().collect();
            seen.sort();
            seen.dedup();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn one_process_is_the_identity() {
        let b = batches(7, 3, false);
        assert_eq!(shard_batches(&b, opts(0, 1, 3)), b);
    }

    #[test]
    fn iterable_shards_complete_the_last_buffer_from_the_first() {
        let shard = |rank, n: usize, drop_last| {
            let o = ShardOptions { drop_last, ..opts(rank, 2, 3) };
            IterableShard::new(0..n, o).collect::<Vec<usize>>()
        };
        assert_eq!(shard(0, 10, false), [0, 1, 2, 6, 7, 8]);
        assert_eq!(shard(1, 10, false), [3, 4, 5, 9, 0, 1]);
        assert_eq!(shard(1, 10, true), [3, 4, 5]);
        // Fewer samples than one buffer: the buffer is completed by repeating them.
        assert_eq!(shard(1, 4, false), [3, 0, 1]);
        let split = ShardOptions { split_batches: true, ..opts(1, 2, 4) };
        assert_eq!(IterableShard::new(0..10usize, split).collect::<Vec<_>>(), [2, 3, 6, 7, 0, 1]);
    }
}
