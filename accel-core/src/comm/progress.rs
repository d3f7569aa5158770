//! Where each rank posts the last collective it entered (the store key and the value's
//! layout): written by the backends' workers (cpu/worker.rs, nccl/), read by the diagnosis
//! of timeouts (cpu/diagnosis.rs) and the ledger's checks (ledger.rs). Its own module so
//! that the ledger, which serves every backend, does not reach into the cpu backend.

/// The store key where group rank `rank` of the group with store prefix `scope` posts the
/// last collective it entered.
pub(crate) fn progress_key(scope: &str, rank: usize) -> String {
    format!("{scope}/progress/{rank}")
}

/// A progress post: the collective's sequence number and its epoch (8 bytes each,
/// little-endian; see `ledger::Ledger::record`), then what it is and where it was called,
/// as text.
pub(crate) fn progress_value(seq: u64, epoch: u64, described: &str) -> Vec<u8> {
    let mut value = seq.to_le_bytes().to_vec();
    value.extend_from_slice(&epoch.to_le_bytes());
    value.extend_from_slice(described.as_bytes());
    value
}

/// The sequence number, epoch and text of a [`progress_value`].
pub(crate) fn parse_progress(bytes: &[u8]) -> Option<(u64, u64, String)> {
    let seq = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let epoch = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
    Some((seq, epoch, String::from_utf8_lossy(&bytes[16..]).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_post_reads_back_and_a_short_one_is_none() {
        let value = progress_value(7, 2, "all_reduce of 3 × f32 at a.rs:1");
        assert_eq!(parse_progress(&value), Some((7, 2, "all_reduce of 3 × f32 at a.rs:1".into())));
        assert_eq!(parse_progress(&value[..12]), None);
        assert_eq!(progress_key("group3", 1), "group3/progress/1");
    }
}
