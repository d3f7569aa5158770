//! The collectives of the cpu backend, over a group's [`Links`]: gloo's ring reduce-scatter
//! and all-gather (all-reduce is one then the other), direct broadcast, and the single-copy
//! variants of direct.rs when every member is on this machine. Received data is reduced by
//! ATen kernels segment by segment while the rest is still arriving.

use std::ops::Range;

use super::buffer::{Buffer, chunks, reduce_into};
use super::diagnosis::FaultResult;
use super::tcp::Links;
use super::wire::Tag;
use crate::comm::ReduceOp;

/// Ring reduce-scatter over `chunks`: afterwards this rank's chunk `rank` holds the reduction
/// of every rank's chunk `rank`.
fn ring_reduce_scatter(
    links: &Links,
    buf: &mut Buffer,
    chunks: &[Range<usize>],
    op: ReduceOp,
    tag: Tag,
) -> FaultResult<()> {
    let (n, rank, kind) = (links.world, links.rank, buf.kind());
    for s in 0..n - 1 {
        let send = chunks[(rank + 2 * n - s - 1) % n].clone();
        let recv = chunks[(rank + 2 * n - s - 2) % n].clone();
        let len = recv.len();
        let (outgoing, incoming) = buf.split(send, recv);
        links.exchange(links.next(), outgoing, links.prev(), len, tag, |offset, bytes| {
            reduce_into(&mut incoming[offset..offset + bytes.len()], bytes, kind, op)
        })?;
    }
    Ok(())
}

/// Ring all-gather over `chunks`, where this rank starts with chunk `rank`.
fn ring_all_gather(
    links: &Links,
    buf: &mut Buffer,
    chunks: &[Range<usize>],
    tag: Tag,
) -> FaultResult<()> {
    let (n, rank) = (links.world, links.rank);
    for s in 0..n - 1 {
        let send = chunks[(rank + n - s) % n].clone();
        let recv = chunks[(rank + 2 * n - s - 1) % n].clone();
        let len = recv.len();
        let (outgoing, incoming) = buf.split(send, recv);
        links.exchange(links.next(), outgoing, links.prev(), len, tag, |offset, bytes| {
            incoming[offset..offset + bytes.len()].copy_from_slice(bytes);
            Ok(())
        })?;
    }
    Ok(())
}

fn equal_chunks(links: &Links, buf: &Buffer) -> Vec<Range<usize>> {
    chunks(buf.len() / buf.elem(), links.world, buf.elem())
}

/// Reduces `buf` across the group, in place.
pub(crate) fn all_reduce(
    links: &Links,
    buf: &mut Buffer,
    op: ReduceOp,
    tag: Tag,
) -> FaultResult<()> {
    if links.world == 1 {
        return Ok(());
    }
    let chunks = equal_chunks(links, buf);
    // An average is divided by its chunk's owner between the two halves, so that each
    // element is divided once, not once per rank (the result is the same to the bit).
    if links.pids.is_some() {
        // Peers read our chunks while we read theirs; the barriers keep anyone from
        // overwriting a chunk that another rank still reads.
        let addrs = links.addresses(buf, tag)?;
        links.direct_reduce_scatter(buf, &chunks, &addrs, op)?;
        average_own_chunk(links, buf, &chunks, op)?;
        links.barrier(tag, 1)?;
        links.direct_all_gather(buf, &chunks, &addrs)?;
        links.barrier(tag, 2)?;
    } else {
        ring_reduce_scatter(links, buf, &chunks, op, tag)?;
        average_own_chunk(links, buf, &chunks, op)?;
        ring_all_gather(links, buf, &chunks, tag)?;
    }
    Ok(())
}

/// Divides this rank's reduced chunk by the group's size if `op` averages.
fn average_own_chunk(
    links: &Links,
    buf: &Buffer,
    chunks: &[Range<usize>],
    op: ReduceOp,
) -> FaultResult<()> {
    if op == ReduceOp::Avg {
        let mine = chunks[links.rank].clone();
        let (start, len) = ((mine.start / buf.elem()) as i64, (mine.len() / buf.elem()) as i64);
        // Flat first: a scalar (0-dim) has no dimension to narrow.
        let flat = buf.tensor().f_view([-1])?;
        let _ = flat.f_narrow(0, start, len)?.f_div_scalar_(links.world as f64)?;
    }
    Ok(())
}

/// `buf` holds every rank's input (world equal chunks); afterwards chunk `rank` holds the
/// reduction (the rest is scratch).
pub(crate) fn reduce_scatter(
    links: &Links,
    buf: &mut Buffer,
    op: ReduceOp,
    tag: Tag,
) -> FaultResult<()> {
    if links.world == 1 {
        return Ok(());
    }
    let chunks = equal_chunks(links, buf);
    if links.pids.is_some() {
        let addrs = links.addresses(buf, tag)?;
        links.direct_reduce_scatter(buf, &chunks, &addrs, op)?;
        links.barrier(tag, 1)?;
    } else {
        ring_reduce_scatter(links, buf, &chunks, op, tag)?;
    }
    average_own_chunk(links, buf, &chunks, op)
}

/// `buf` has room for every rank's part, this rank's already in place at slot `rank`.
pub(crate) fn all_gather(links: &Links, buf: &mut Buffer, tag: Tag) -> FaultResult<()> {
    if links.world == 1 {
        return Ok(());
    }
    let chunks = equal_chunks(links, buf);
    if links.pids.is_some() {
        let addrs = links.addresses(buf, tag)?;
        links.direct_all_gather(buf, &chunks, &addrs)?;
        return links.barrier(tag, 2);
    }
    ring_all_gather(links, buf, &chunks, tag)
}

/// Copies rank `root`'s `buf` into every rank's.
pub(crate) fn broadcast(links: &Links, buf: &mut Buffer, root: usize, tag: Tag) -> FaultResult<()> {
    if links.world == 1 {
        return Ok(());
    }
    let all = 0..buf.len();
    if links.rank == root {
        let data = buf.bytes(all);
        std::thread::scope(|scope| {
            let sends: Vec<_> = (0..links.world)
                .filter(|&p| p != root)
                .map(|p| scope.spawn(move || links.send(p, tag, data)))
                .collect();
            sends.into_iter().try_for_each(|h| h.join().unwrap_or(Ok(())))
        })
    } else {
        links.recv_into(root, tag, buf.bytes_mut(all))
    }
}
