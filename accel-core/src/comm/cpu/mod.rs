//! The `cpu` backend's transport, by concern: the wire format (wire.rs), TCP links between
//! every pair of ranks (tcp.rs), the single-copy path between processes of one machine
//! (direct.rs) and its signals (mailbox.rs), byte views of tensors (buffer.rs), the
//! collective algorithms (ring.rs), the worker thread that runs a group's transfers in
//! order (worker.rs), and the diagnosis of failures (diagnosis.rs).
//! [`crate::comm::ProcessGroup`] is its front.

pub(crate) mod buffer;
pub(crate) mod diagnosis;
pub(crate) mod direct;
pub(crate) mod mailbox;
pub(crate) mod ring;
pub(crate) mod tcp;
pub(crate) mod wire;
pub(crate) mod worker;

/// The largest object (serialised) a peer may announce: control messages are small, and a
/// corrupt length must not make this rank allocate without bound.
pub(crate) const OBJECT_LIMIT: u64 = 256 << 20;
