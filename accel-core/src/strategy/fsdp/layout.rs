//! Where each element of a sharded parameter lives: every rank's chunk of a flattened,
//! zero-padded parameter; a unit's flat buffer laid out rank-major (every rank's chunks of
//! every member side by side, so one collective serves the whole unit); and which unit each
//! parameter belongs to.

use std::collections::BTreeSet;

use tch::Tensor;

use crate::error::Result;

/// Layer-list names whose numbered elements become units by default.
const REPEATED: &[&str] = &["layers", "layer", "h", "blocks"];

/// Rank `rank`'s share of a flattened tensor split `world` ways: `ceil(n / world)` elements,
/// zero-padded at the end of the last share.
pub(crate) fn chunk_of(flat: &Tensor, rank: usize, world: usize) -> Result<Tensor> {
    let (n, world) = (flat.numel() as i64, world as i64);
    let chunk = (n + world - 1) / world;
    // Only the chunk is read or copied (never a padded copy of the whole: a model loaded
    // into shards would hold each parameter whole for a moment).
    let start = (chunk * rank as i64).min(n);
    let len = chunk.min(n - start);
    let part = flat.f_reshape([-1])?.f_narrow(0, start, len)?;
    if len == chunk {
        return Ok(part.f_contiguous()?);
    }
    Ok(part.f_constant_pad_nd([0, chunk - len])?)
}

/// One member's place in a unit's flat buffer: `[world, chunk]`, row r being rank r's chunk.
pub(crate) fn columns(
    buffer: &Tensor,
    world: i64,
    segment: i64,
    offset: i64,
    chunk: i64,
) -> Result<Tensor> {
    Ok(buffer.f_view([world, segment])?.f_narrow(1, offset, chunk)?)
}

/// Copies the `numel` elements of `flat` into `columns` in row-major order (the padding
/// left as it is), without a padded temporary.
pub(crate) fn copy_into_columns(
    columns: &Tensor,
    flat: &Tensor,
    numel: i64,
    chunk: i64,
) -> Result<()> {
    let (rows, rest) = (numel / chunk.max(1), numel % chunk.max(1));
    if rows > 0 {
        let source = flat.f_narrow(0, 0, rows * chunk)?.f_view([rows, chunk])?;
        columns.f_narrow(0, 0, rows)?.f_copy_(&source)?;
    }
    if rest > 0 {
        let source = flat.f_narrow(0, rows * chunk, rest)?;
        columns.f_select(0, rows)?.f_narrow(0, 0, rest)?.f_copy_(&source)?;
    }
    Ok(())
}

/// The inverse of [`copy_into_columns`]: the first `numel` elements of `columns`, in
/// row-major order, into `flat`.
pub(crate) fn copy_from_columns(
    columns: &Tensor,
    flat: &Tensor,
    numel: i64,
    chunk: i64,
) -> Result<()> {
    let (rows, rest) = (numel / chunk.max(1), numel % chunk.max(1));
    if rows > 0 {
        let mut target = flat.f_narrow(0, 0, rows * chunk)?.f_view([rows, chunk])?;
        target.f_copy_(&columns.f_narrow(0, 0, rows)?)?;
    }
    if rest > 0 {
        let source = columns.f_select(0, rows)?.f_narrow(0, 0, rest)?;
        flat.f_narrow(0, rows * chunk, rest)?.f_copy_(&source)?;
    }
    Ok(())
}

/// For each parameter, the innermost module prefix holding at least `min` elements (none:
/// the root); the distinct prefixes, for [`unit_of`].
pub(crate) fn size_based_units(params: &[(&str, i64)], min: i64) -> Vec<String> {
    let mut totals: std::collections::BTreeMap<String, i64> = Default::default();
    for (name, numel) in params {
        let parts: Vec<&str> = name.split('.').collect();
        for end in 1..parts.len() {
            *totals.entry(parts[..end].join(".")).or_default() += numel;
        }
    }
    let mut units = BTreeSet::new();
    for (name, _) in params {
        let parts: Vec<&str> = name.split('.').collect();
        if let Some(end) =
            (1..parts.len()).rev().find(|&end| totals[&parts[..end].join(".")] >= min)
        {
            units.insert(parts[..end].join("."));
        }
    }
    units.into_iter().collect()
}

/// The unit prefix of parameter `name`: the longest matching explicit or wrapped prefix,
/// else the longest size-based one (when `sized` is given), else its repeated-layer
/// element (`....layers.3`), else the root (`""`).
pub(crate) fn unit_of(
    name: &str,
    explicit: Option<&[String]>,
    wrapped: &BTreeSet<String>,
    sized: Option<&[String]>,
) -> String {
    let longest = |prefixes: &mut dyn Iterator<Item = &String>| {
        prefixes.filter(|p| name.starts_with(&format!("{p}."))).max_by_key(|p| p.len()).cloned()
    };
    if let Some(list) = explicit {
        return longest(&mut list.iter()).unwrap_or_default();
    }
    if let Some(p) = longest(&mut wrapped.iter()) {
        return p;
    }
    if let Some(list) = sized {
        return longest(&mut list.iter()).unwrap_or_default();
    }
    let parts: Vec<&str> = name.split('.').collect();
    for i in 0..parts.len().saturating_sub(2) {
        if REPEATED.contains(&parts[i]) && parts[i + 1].parse::<u64>().is_ok() {
            return parts[..i + 2].join(".");
        }
    }
    String::new()
}

/// Elements of the variables under `prefix` (`sizes`: each variable's name and size).
pub(super) fn unit_size(sizes: &[(&str, i64)], prefix: &str) -> i64 {
    sizes
        .iter()
        .filter(|(name, _)| name.starts_with(prefix) && name[prefix.len()..].starts_with('.'))
        .map(|(_, n)| n)
        .sum()
}
