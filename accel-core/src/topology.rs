//! Where this process stands: rank, world size, local rank, the master's address — read
//! from `accel launch`, torchrun, Slurm or Open MPI variables, checked for consistency.

use crate::error::{Error, Result};

/// The place of one process in a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Global rank, 0..world_size.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank on this machine, 0..local_world_size.
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Address of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store (`MASTER_PORT`, or `MASTER_PORT + 1` under
    /// torchrun, whose own store holds `MASTER_PORT`).
    pub master_port: u16,
    /// Which launcher's variables were read.
    pub source: &'static str,
}

impl Topology {
    /// One process on its own.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            source: "none (one process)",
        }
    }

    /// Machine index (ranks are laid out machine by machine).
    pub fn node_rank(&self) -> usize {
        self.rank / self.local_world_size
    }

    /// Number of machines.
    pub fn num_nodes(&self) -> usize {
        self.world_size / self.local_world_size
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(|k| std::env::var(k).ok())
    }

    /// Reads variables through `get`: torchrun's / `accel launch`'s (`RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) first, then Open
    /// MPI's (`OMPI_COMM_WORLD_*`), then Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, ...).
    pub fn from_env_with(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |name: &str| -> Result<Option<usize>> {
            match get(name) {
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| {
                    Error::Config(format!("{name}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let (source, rank, world, local_rank, local_world) = if get("RANK").is_some()
            || get("WORLD_SIZE").is_some()
        {
            let source = if get("ACCEL_LAUNCHED").is_some() {
                "accel launch"
            } else if get("TORCHELASTIC_RUN_ID").is_some() {
                "torchrun"
            } else {
                "RANK/WORLD_SIZE"
            };
            (source, num("RANK")?, num("WORLD_SIZE")?, num("LOCAL_RANK")?, num("LOCAL_WORLD_SIZE")?)
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            (
                "Open MPI",
                num("OMPI_COMM_WORLD_RANK")?,
                num("OMPI_COMM_WORLD_SIZE")?,
                num("OMPI_COMM_WORLD_LOCAL_RANK")?,
                num("OMPI_COMM_WORLD_LOCAL_SIZE")?,
            )
        } else if get("SLURM_PROCID").is_some() {
            // Slurm writes e.g. "4(x2)" for uneven layouts; then count from the totals.
            let per_node = num("SLURM_NTASKS_PER_NODE").unwrap_or_default();
            let per_node = per_node.or(match (num("SLURM_NTASKS")?, num("SLURM_NNODES")?) {
                (Some(t), Some(n)) if n > 0 => Some(t / n),
                _ => None,
            });
            ("Slurm", num("SLURM_PROCID")?, num("SLURM_NTASKS")?, num("SLURM_LOCALID")?, per_node)
        } else {
            return Ok(Self::single());
        };
        let rank = rank.unwrap_or(0);
        let world_size = world.ok_or_else(|| {
            Error::Config(format!("{source}: a rank ({rank}) is set but no world size"))
        })?;
        let local_rank = local_rank.unwrap_or(rank);
        let local_world_size =
            local_world.unwrap_or(if local_rank == rank { world_size } else { 0 });
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = get("MASTER_PORT").unwrap_or_else(|| "29500".into());
        let mut master_port: u16 = port.trim().parse().map_err(|_| {
            Error::Config(format!("MASTER_PORT={port:?} is not a port number (1-65535)"))
        })?;
        // torchrun's agent already serves its own store on MASTER_PORT; ours takes the next.
        if get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            master_port = master_port.checked_add(1).ok_or_else(|| {
                Error::Config(
                    "MASTER_PORT=65535 leaves no port for accel's store under torchrun".into(),
                )
            })?;
        }
        let topology = Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            source,
        };
        topology.check()?;
        Ok(topology)
    }

    /// Consistency, with the arithmetic in the message.
    pub fn check(&self) -> Result<()> {
        // Per-rank tables are sized by the world: bound it before anything is allocated.
        const MAX_WORLD_SIZE: usize = 1 << 20;
        let s = self.source;
        let fail = |why: String| Err(Error::Config(format!("{s}: {why}")));
        if self.world_size == 0 {
            return fail("world size 0: there must be at least one process".into());
        }
        if self.world_size > MAX_WORLD_SIZE {
            return fail(format!(
                "world size {} is over the {MAX_WORLD_SIZE} processes accel accepts (a typo?)",
                self.world_size
            ));
        }
        if self.rank >= self.world_size {
            return fail(format!(
                "rank {} is not below world size {} (ranks are 0..{})",
                self.rank,
                self.world_size,
                self.world_size - 1
            ));
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            return fail(format!(
                "local rank {} is not below local world size {}",
                self.local_rank, self.local_world_size
            ));
        }
        if self.world_size % self.local_world_size != 0 {
            return fail(format!(
                "world size {} is not a multiple of {} processes per machine ({} = {} × {} + {})",
                self.world_size,
                self.local_world_size,
                self.world_size,
                self.local_world_size,
                self.world_size / self.local_world_size,
                self.world_size % self.local_world_size
            ));
        }
        if self.rank % self.local_world_size != self.local_rank {
            return fail(format!(
                "rank {} with {} processes per machine must have local rank {} ({} mod {}), not {}",
                self.rank,
                self.local_world_size,
                self.rank % self.local_world_size,
                self.rank,
                self.local_world_size,
                self.local_rank
            ));
        }
        if self.master_port == 0 {
            return fail(
                "MASTER_PORT=0: the processes need the actual port of rank 0's store".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> =
            vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn torchrun_variables() {
        let t = Topology::from_env_with(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("TORCHELASTIC_RUN_ID", "x"),
        ]))
        .unwrap();
        assert_eq!((t.rank, t.world_size, t.local_rank, t.local_world_size), (3, 4, 1, 2));
        assert_eq!((t.node_rank(), t.num_nodes(), t.source), (1, 2, "torchrun"));
        assert_eq!((t.master_addr.as_str(), t.master_port), ("10.0.0.1", 1234));
    }

    #[test]
    fn slurm_and_open_mpi_variables() {
        let t = Topology::from_env_with(env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NNODES", "2"),
        ]))
        .unwrap();
        assert_eq!((t.rank, t.world_size, t.local_rank, t.local_world_size), (5, 8, 1, 4));
        let t = Topology::from_env_with(env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
        ]))
        .unwrap();
        assert_eq!((t.rank, t.world_size, t.source), (2, 3, "Open MPI"));
        assert_eq!(Topology::from_env_with(env(&[])).unwrap(), Topology::single());
    }

    #[test]
    fn inconsistent_values_show_the_arithmetic() {
        let err =
            |vars: &[(&str, &str)]| Topology::from_env_with(env(vars)).unwrap_err().to_string();
        let e = err(&[("RANK", "4"), ("WORLD_SIZE", "4")]);
        assert!(e.contains("rank 4 is not below world size 4 (ranks are 0..3)"), "{e}");
        let e = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "5"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]);
        assert!(e.contains("5 = 2 × 2 + 1"), "{e}");
        let e = err(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]);
        assert!(e.contains("must have local rank 1 (3 mod 2)"), "{e}");
        let e = err(&[("RANK", "0"), ("WORLD_SIZE", "1000000000000")]);
        assert!(e.contains("world size 1000000000000 is over"), "{e}");
        let e = err(&[("RANK", "x"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("RANK=\"x\""), "{e}");
        let e = err(&[("RANK", "0")]);
        assert!(e.contains("no world size"), "{e}");
    }
}
