//! The collectives of the cpu backend, over a group's [`Links`]: gloo's ring reduce-scatter
//! and all-gather (all-reduce is one then the other), direct broadcast, the single-copy
//! variants of direct.rs when every member is on this machine, and both joined when the
//! group spans machines with equal numbers of members: direct copies within each machine,
//! rings over TCP between the members at the same place on every machine (as NCCL's
//! hierarchical algorithms do). Received data is reduced by ATen kernels segment by segment
//! while the rest is still arriving.

use std::ops::Range;

use super::buffer::{Buffer, chunks, reduce_into};
use super::diagnosis::FaultResult;
use super::tcp::{Links, Ring};
use super::wire::Tag;
use crate::comm::ReduceOp;

/// How a collective moves its data.
enum Path {
    /// Single copies between every member (all on this machine).
    Direct,
    /// Single copies within each machine, rings over TCP between the machines.
    Mixed,
    /// Rings over TCP between every member.
    Tcp,
}

fn path(links: &Links) -> Path {
    match (&links.pids, links.machines.len()) {
        (None, _) => Path::Tcp,
        (Some(_), 1) => Path::Direct,
        _ => Path::Mixed,
    }
}

/// Ring reduce-scatter over `chunks` (by place in `ring`): afterwards this rank's chunk
/// `ring.me` holds the reduction of every member's.
fn ring_reduce_scatter(
    links: &Links,
    ring: Ring,
    buf: &mut Buffer,
    chunks: &[Range<usize>],
    op: ReduceOp,
    tag: Tag,
) -> FaultResult<()> {
    let (n, me, kind) = (ring.len(), ring.me, buf.kind());
    for s in 0..n - 1 {
        let send = chunks[(me + 2 * n - s - 1) % n].clone();
        let recv = chunks[(me + 2 * n - s - 2) % n].clone();
        let len = recv.len();
        let (outgoing, incoming) = buf.split(send, recv);
        links.exchange(ring.next(), outgoing, ring.prev(), len, tag, |offset, bytes| {
            reduce_into(&mut incoming[offset..offset + bytes.len()], bytes, kind, op)
        })?;
    }
    Ok(())
}

/// Ring all-gather over `chunks` (by place in `ring`), where this rank starts with chunk
/// `ring.me`.
fn ring_all_gather(
    links: &Links,
    ring: Ring,
    buf: &mut Buffer,
    chunks: &[Range<usize>],
    tag: Tag,
) -> FaultResult<()> {
    let (n, me) = (ring.len(), ring.me);
    for s in 0..n - 1 {
        let send = chunks[(me + n - s) % n].clone();
        let recv = chunks[(me + 2 * n - s - 1) % n].clone();
        let len = recv.len();
        let (outgoing, incoming) = buf.split(send, recv);
        links.exchange(ring.next(), outgoing, ring.prev(), len, tag, |offset, bytes| {
            incoming[offset..offset + bytes.len()].copy_from_slice(bytes);
            Ok(())
        })?;
    }
    Ok(())
}

fn equal_chunks(links: &Links, buf: &Buffer) -> Vec<Range<usize>> {
    chunks(buf.len() / buf.elem(), links.world, buf.elem())
}

/// One region each.
fn singly(chunks: &[Range<usize>]) -> Vec<Vec<Range<usize>>> {
    chunks.iter().map(|c| vec![c.clone()]).collect()
}

/// The sum for an average's first half (each element is divided once, at the end).
fn summing(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg { ReduceOp::Sum } else { op }
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
    // An average is divided by its chunk's owner between the two halves, so that each
    // element is divided once, not once per rank (the result is the same to the bit).
    match path(links) {
        Path::Direct => {
            let chunks = equal_chunks(links, buf);
            // Peers read our chunks while we read theirs; the barriers keep anyone from
            // overwriting a chunk that another rank still reads.
            let addrs = links.addresses(buf, tag)?;
            links.direct_reduce_scatter(buf, &singly(&chunks), &addrs, op)?;
            average(links, buf, &chunks[links.rank], op)?;
            links.barrier(tag, 1)?;
            links.direct_all_gather(buf, &singly(&chunks), &addrs)?;
            links.barrier(tag, 2)?;
        }
        Path::Mixed => {
            // This machine's sum of chunk `place` at its place-th member, reduced over TCP
            // with the members at the same place on the other machines, then gathered back.
            let (place, elem) = (links.place(), buf.elem());
            let local = chunks(buf.len() / elem, links.local().len(), elem);
            let addrs = links.addresses(buf, tag)?;
            links.direct_reduce_scatter(buf, &singly(&local), &addrs, summing(op))?;
            let across = links.across(place);
            let ring = Ring { members: &across, me: links.machine };
            let mine = local[place].clone();
            let parts: Vec<Range<usize>> = chunks(mine.len() / elem, across.len(), elem)
                .into_iter()
                .map(|r| mine.start + r.start..mine.start + r.end)
                .collect();
            ring_reduce_scatter(links, ring, buf, &parts, summing(op), tag)?;
            average(links, buf, &parts[links.machine], op)?;
            ring_all_gather(links, ring, buf, &parts, tag)?;
            links.barrier(tag, 1)?;
            links.direct_all_gather(buf, &singly(&local), &addrs)?;
            links.barrier(tag, 2)?;
        }
        Path::Tcp => {
            let chunks = equal_chunks(links, buf);
            let ring = links.whole();
            ring_reduce_scatter(links, ring, buf, &chunks, op, tag)?;
            average(links, buf, &chunks[links.rank], op)?;
            ring_all_gather(links, ring, buf, &chunks, tag)?;
        }
    }
    Ok(())
}

/// Divides the reduced `range` of `buf` by the group's size if `op` averages.
fn average(links: &Links, buf: &Buffer, range: &Range<usize>, op: ReduceOp) -> FaultResult<()> {
    if op == ReduceOp::Avg {
        let (start, len) = ((range.start / buf.elem()) as i64, (range.len() / buf.elem()) as i64);
        // Flat first: a scalar (0-dim) has no dimension to narrow.
        let flat = buf.tensor().f_view([-1])?;
        let _ = flat.f_narrow(0, start, len)?.f_div_scalar_(links.world as f64)?;
    }
    Ok(())
}

/// The group's equal chunks that the members at each place of a machine own (place `j`:
/// chunk of the `j`-th member of every machine, in machine order).
fn by_place(links: &Links, chunks: &[Range<usize>]) -> Vec<Vec<Range<usize>>> {
    (0..links.local().len())
        .map(|j| links.across(j).into_iter().map(|r| chunks[r].clone()).collect())
        .collect()
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
    match path(links) {
        Path::Direct => {
            let addrs = links.addresses(buf, tag)?;
            links.direct_reduce_scatter(buf, &singly(&chunks), &addrs, op)?;
            links.barrier(tag, 1)?;
        }
        Path::Mixed => {
            // This machine's sums of the chunks owned by the members at this rank's place on
            // every machine, then reduced over TCP between those members.
            let regions = by_place(links, &chunks);
            let place = links.place();
            let addrs = links.addresses(buf, tag)?;
            links.direct_reduce_scatter(buf, &regions, &addrs, op)?;
            let across = links.across(place);
            let ring = Ring { members: &across, me: links.machine };
            ring_reduce_scatter(links, ring, buf, &regions[place], op, tag)?;
            links.barrier(tag, 1)?;
        }
        Path::Tcp => {
            ring_reduce_scatter(links, links.whole(), buf, &chunks, op, tag)?;
        }
    }
    average(links, buf, &chunks[links.rank], op)
}

/// `buf` has room for every rank's part, this rank's already in place at slot `rank`.
pub(crate) fn all_gather(links: &Links, buf: &mut Buffer, tag: Tag) -> FaultResult<()> {
    if links.world == 1 {
        return Ok(());
    }
    let chunks = equal_chunks(links, buf);
    match path(links) {
        Path::Direct => {
            let addrs = links.addresses(buf, tag)?;
            links.direct_all_gather(buf, &singly(&chunks), &addrs)?;
            links.barrier(tag, 2)
        }
        Path::Mixed => {
            // The chunks of the members at this rank's place on every machine over TCP,
            // then each place's from this machine's other members (the exchange of
            // addresses tells that they have theirs).
            let regions = by_place(links, &chunks);
            let place = links.place();
            let across = links.across(place);
            let ring = Ring { members: &across, me: links.machine };
            ring_all_gather(links, ring, buf, &regions[place], tag)?;
            let addrs = links.addresses(buf, tag)?;
            links.direct_all_gather(buf, &regions, &addrs)?;
            links.barrier(tag, 2)
        }
        Path::Tcp => ring_all_gather(links, links.whole(), buf, &chunks, tag),
    }
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
