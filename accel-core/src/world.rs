//! One world group per process, as Accelerate's `PartialState` is one per process: the
//! first accelerator of a run joins the rendezvous, and every later one in the same process
//! (an `#[accelerate]` function called once per epoch, pretraining then fine-tuning, two
//! annotated functions one after the other) reuses its group — and its mesh of
//! communicators, where the parallel dimensions and the device are the same — instead of
//! meeting the other processes again on a port that is still taken. Above `comm` and
//! `mesh` (it keeps a group and the meshes made over it).

use std::sync::Mutex;

use tch::Device;

use crate::comm::{GroupOptions, ProcessGroup};
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, ParallelDims};
use crate::sync::Locked;
use crate::topology::Topology;

/// The process's world, once joined.
struct World {
    topology: Topology,
    group: ProcessGroup,
    /// Who joined it ("`train` at src/main.rs:12", or "the accelerator built at ..").
    made_by: String,
    /// The last mesh made over it.
    mesh: Option<(ParallelDims, Device, DeviceMesh)>,
    /// Why it can no longer be used (a run that failed aborted it).
    aborted: Option<String>,
}

static WORLD: Mutex<Option<World>> = Mutex::new(None);

fn world() -> std::sync::MutexGuard<'static, Option<World>> {
    WORLD.locked()
}

/// The mesh for a run of `topology` with `dims` on `device`, made by `who`: the process's
/// world group (joined now if this is the first run) and a mesh over it (the last run's,
/// if it had the same dimensions and device).
pub(crate) fn mesh_for(
    topology: &Topology,
    options: GroupOptions,
    dims: ParallelDims,
    device: Device,
    who: &str,
) -> Result<DeviceMesh> {
    let mut guard = world();
    if let Some(w) = guard.as_ref() {
        if let Some(why) = &w.aborted {
            return Err(Error::Rendezvous(format!(
                "{who} cannot train: this process's group, made by {}, was aborted when {why}; \
                 after a failed run the processes cannot meet again within the same program — \
                 restart them (`accel launch --max-restarts N` does it by itself)",
                w.made_by
            )));
        }
        if w.topology != *topology {
            return Err(Error::Config(format!(
                "{who} runs as rank {} of {} (from {}), but this process already joined a run as \
                 rank {} of {} (from {}) for {}: one process takes one place in one run; keep \
                 the launcher's variables unchanged between the calls",
                topology.rank,
                topology.world_size,
                topology.source,
                w.topology.rank,
                w.topology.world_size,
                w.topology.source,
                w.made_by
            )));
        }
    } else {
        let group = ProcessGroup::new(topology, options)?;
        *guard = Some(World {
            topology: topology.clone(),
            group,
            made_by: who.to_owned(),
            mesh: None,
            aborted: None,
        });
    }
    let w = guard.as_mut().expect("joined above");
    if let Some((d, dev, mesh)) = &w.mesh {
        if *d == dims && *dev == device {
            return Ok(mesh.clone());
        }
    }
    let mesh = DeviceMesh::new(dims, &w.group, device)?;
    w.mesh = Some((dims, device, mesh.clone()));
    Ok(mesh)
}

/// The run that used the process's world failed and aborted it: later runs are told why.
pub(crate) fn mark_aborted(why: String) {
    if let Some(w) = world().as_mut() {
        w.aborted.get_or_insert(why);
    }
}
