//! Where this process stands: rank, world size, local rank, the master's address — read
//! from the variables a launcher sets (`accel launch`, torchrun, Kubernetes' PyTorchJob,
//! Slurm's `srun`, Open MPI, MPICH / Intel MPI, MVAPICH), checked for consistency.
//!
//! A launcher's variables that are present but incomplete or at odds are an error naming
//! them: a process never falls back to training alone while its peers wait.

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

/// The port rank 0's store takes when nothing names one (torch's default).
pub const DEFAULT_PORT: u16 = 29500;

/// One launcher's variables: rank, world, local rank, local world.
struct Family {
    source: &'static str,
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
    local_world: &'static str,
}

/// The MPI launchers, in the order their variables are read (an MPI launcher started
/// inside a Slurm allocation leaves Slurm's variables of the allocation behind, so these
/// come before Slurm's).
const MPI: [Family; 3] = [
    Family {
        source: "Open MPI",
        rank: "OMPI_COMM_WORLD_RANK",
        world: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_world: "OMPI_COMM_WORLD_LOCAL_SIZE",
    },
    Family {
        source: "MPICH / Intel MPI",
        rank: "PMI_RANK",
        world: "PMI_SIZE",
        local_rank: "MPI_LOCALRANKID",
        local_world: "MPI_LOCALNRANKS",
    },
    Family {
        source: "MVAPICH",
        rank: "MV2_COMM_WORLD_RANK",
        world: "MV2_COMM_WORLD_SIZE",
        local_rank: "MV2_COMM_WORLD_LOCAL_RANK",
        local_world: "MV2_COMM_WORLD_LOCAL_SIZE",
    },
];

/// Variables that say a launcher started this process as one of several, though accel
/// reads the run from none of them: seen alone, they are an error, never a 1-process run.
const UNREAD: [&str; 4] = ["PMIX_RANK", "LOCAL_RANK", "GROUP_RANK", "SLURM_STEP_NUM_TASKS"];

impl Topology {
    /// One process on its own.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_PORT,
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

    /// Reads variables through `get`, the first launcher whose rank variable is set:
    /// torchrun's / `accel launch`'s / Kubernetes' (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`), Open MPI's (`OMPI_COMM_WORLD_*`), MPICH's and Intel MPI's
    /// (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`), MVAPICH's
    /// (`MV2_COMM_WORLD_*`), then Slurm's (`SLURM_PROCID`, ...). `MASTER_ADDR` and
    /// `MASTER_PORT` name rank 0's store; under Slurm they default to the step's first host
    /// and a port derived from the job id.
    pub fn from_env_with(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let num = |name: &str| -> Result<Option<usize>> {
            match get(name) {
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| {
                    Error::Config(format!("{name}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let need = |source: &str, name: &str, why: &str| -> Result<usize> {
            num(name)?.ok_or_else(|| {
                Error::Config(format!(
                    "{source}: {name} is not set{why}; accel will not run this process on its \
                     own while its peers wait for it"
                ))
            })
        };
        let master_port = || -> Result<Option<u16>> {
            get("MASTER_PORT")
                .map(|port| match port.trim().parse::<u16>() {
                    Ok(p) => Ok(p),
                    Err(_) => Err(Error::Config(format!(
                        "MASTER_PORT={port:?} is not a port number (1-65535)"
                    ))),
                })
                .transpose()
        };

        let mut addr_hint = "";
        let mut topology = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            let source = if get(crate::config::env::LAUNCHED).is_some() {
                "accel launch"
            } else if get("TORCHELASTIC_RUN_ID").is_some() {
                "torchrun"
            } else {
                "RANK/WORLD_SIZE"
            };
            let world = need(source, "WORLD_SIZE", " though RANK is")?;
            let rank = match num("RANK")? {
                Some(r) => r,
                None if world == 1 => 0,
                None => need(source, "RANK", &format!(" though WORLD_SIZE={world} is"))?,
            };
            // Kubernetes' PyTorchJob and plain env:// setups set no local variables: one
            // process per pod (or host), so rank 0 of 1 there, and the pod's own device.
            let (local_rank, local_world) = match (num("LOCAL_RANK")?, num("LOCAL_WORLD_SIZE")?) {
                (None, None) => (0, 1),
                (Some(l), Some(w)) => (l, w),
                (Some(l), None) => (l, need(source, "LOCAL_WORLD_SIZE", " though LOCAL_RANK is")?),
                (None, Some(w)) => (need(source, "LOCAL_RANK", " though LOCAL_WORLD_SIZE is")?, w),
            };
            addr_hint = "set MASTER_ADDR to the address of rank 0's host";
            let port = master_port()?.unwrap_or(DEFAULT_PORT);
            let addr = get("MASTER_ADDR").unwrap_or_default();
            Self::at(source, [rank, world, local_rank, local_world], addr, port)
        } else if let Some(f) = MPI.iter().find(|f| get(f.rank).is_some()) {
            let rank = need(f.source, f.rank, "")?;
            let world = need(f.source, f.world, &format!(" though {} is", f.rank))?;
            let local_rank = need(f.source, f.local_rank, &format!(" though {} is", f.rank))?;
            let local_world = need(f.source, f.local_world, &format!(" though {} is", f.rank))?;
            addr_hint = "export MASTER_ADDR=<address of the first host> and pass it on (Open \
                         MPI: mpirun -x MASTER_ADDR ...; MPICH, Intel MPI: mpiexec -genv \
                         MASTER_ADDR $MASTER_ADDR ...)";
            let port = master_port()?.unwrap_or(DEFAULT_PORT);
            let addr = get("MASTER_ADDR").unwrap_or_default();
            Self::at(f.source, [rank, world, local_rank, local_world], addr, port)
        } else if get("SLURM_PROCID").is_some() {
            let port = master_port()?;
            Self::slurm(&get, &need, port)?
        } else if let Some(name) = UNREAD.iter().find(|n| get(n).is_some()) {
            return Err(Error::Config(format!(
                "{name} is set, so a launcher started this process as one of several, but none \
                 of the variables accel reads a run from is: RANK and WORLD_SIZE (torchrun, \
                 accel launch, Kubernetes), OMPI_COMM_WORLD_* (Open MPI), PMI_RANK and \
                 PMI_SIZE (MPICH, Intel MPI), MV2_COMM_WORLD_* (MVAPICH) or SLURM_PROCID \
                 (srun). Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and \
                 MASTER_PORT, or start it with accel launch; accel will not run this process \
                 on its own while its peers wait for it"
            )));
        } else {
            return Ok(Self::single());
        };
        // torchrun's agent already serves its own store on MASTER_PORT; ours takes the next.
        if get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            topology.master_port = topology.master_port.checked_add(1).ok_or_else(|| {
                Error::Config(
                    "MASTER_PORT=65535 leaves no port for accel's store under torchrun".into(),
                )
            })?;
        }
        topology.check()?;
        if topology.master_addr.is_empty() {
            // Loopback is rank 0's address only when every process is on this machine.
            if topology.num_nodes() > 1 {
                return Err(Error::Config(format!(
                    "{}: {} processes, {} on each machine, so some run on other machines, but \
                     MASTER_ADDR is not set and 127.0.0.1 on those machines is not rank 0's: \
                     {addr_hint}",
                    topology.source, topology.world_size, topology.local_world_size
                )));
            }
            topology.master_addr = "127.0.0.1".into();
        }
        Ok(topology)
    }

    fn at(source: &'static str, sizes: [usize; 4], master_addr: String, master_port: u16) -> Self {
        let [rank, world_size, local_rank, local_world_size] = sizes;
        Self { rank, world_size, local_rank, local_world_size, master_addr, master_port, source }
    }

    /// `srun`'s variables. Slurm names the step's hosts, so rank 0's host is the first of
    /// them, and its port comes from the job and step ids (two steps of one job running at
    /// once get different ports) unless `MASTER_PORT` is set.
    fn slurm(
        get: &impl Fn(&str) -> Option<String>,
        need: &impl Fn(&str, &str, &str) -> Result<usize>,
        port: Option<u16>,
    ) -> Result<Self> {
        let s = "Slurm";
        let by_srun = " though SLURM_PROCID is (srun sets it: start the program with srun)";
        let rank = need(s, "SLURM_PROCID", "")?;
        let world = match get("SLURM_STEP_NUM_TASKS") {
            Some(_) => need(s, "SLURM_STEP_NUM_TASKS", "")?,
            None => need(s, "SLURM_NTASKS", by_srun)?,
        };
        if world > 1 && get("SLURM_STEP_ID").or_else(|| get("SLURM_STEPID")).is_none() {
            // sbatch's script sees the job's task count but is one process, not task 0.
            return Err(Error::Config(format!(
                "{s}: this is the batch script of a job of {world} tasks, not one of its tasks \
                 (SLURM_PROCID is set, SLURM_STEP_ID is not): start the program with `srun \
                 PROGRAM`, one process per task, or `srun --ntasks-per-node=1 accel launch \
                 --num-processes K PROGRAM`"
            )));
        }
        let local_rank = need(s, "SLURM_LOCALID", by_srun)?;
        let node = need(s, "SLURM_NODEID", by_srun)?;
        let (spec_name, spec) = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
            .into_iter()
            .find_map(|k| get(k).map(|v| (k, v)))
            .ok_or_else(|| {
                Error::Config(format!("{s}: SLURM_STEP_TASKS_PER_NODE is not set{by_srun}"))
            })?;
        let local_world = tasks_on_node(&spec, node).ok_or_else(|| {
            Error::Config(format!(
                "{s}: {spec_name}={spec:?} names no task count for node {node} (SLURM_NODEID)"
            ))
        })?;
        let addr = match get("MASTER_ADDR") {
            Some(addr) => addr,
            None => slurm_first_host(get)?,
        };
        let port = port.unwrap_or_else(|| slurm_job_port(get));
        Ok(Self::at(s, [rank, world, local_rank, local_world], addr, port))
    }

    /// Consistency, with the arithmetic in the message.
    pub fn check(&self) -> Result<()> {
        // Per-rank tables are sized by the world: bound it before anything is allocated.
        const MAX_WORLD_SIZE: usize = 1 << 20;
        let s = self.source;
        // accel lays ranks out machine by machine, the same number on each.
        let layout = match s {
            "Slurm" => {
                "; accel needs the same number of tasks on every node, ranks in node order: srun \
                 --ntasks-per-node=K --distribution=block"
            }
            "Open MPI" => "; accel needs ranks in node order: mpirun --map-by slot (the default)",
            _ => "",
        };
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
                "local rank {} is not below local world size {}{layout}",
                self.local_rank, self.local_world_size
            ));
        }
        if self.world_size % self.local_world_size != 0 {
            return fail(format!(
                "world size {} is not a multiple of {} processes per machine ({} = {} × {} + {}){layout}",
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
                "rank {} with {} processes per machine must have local rank {} ({} mod {}), not {}{layout}",
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

/// The machines of a Slurm step that runs `accel launch` once per node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmMachines {
    /// Nodes in the step (`SLURM_STEP_NUM_NODES`).
    pub num_machines: usize,
    /// This node's index (`SLURM_NODEID`).
    pub machine_rank: usize,
    /// The step's first host, where machine 0's launcher serves the store.
    pub main_process_ip: String,
    /// From the job and step ids ([`slurm_port`]).
    pub main_process_port: u16,
}

impl SlurmMachines {
    /// What `srun accel launch ...` takes from Slurm: `None` outside an srun step. A step
    /// with more than one task on a node is refused: each launcher starts its node's
    /// processes itself.
    pub fn from_env_with(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        if get("SLURM_PROCID").is_none() || get("SLURM_STEP_ID").is_none() {
            return Ok(None);
        }
        let num = |k: &str| -> Result<usize> {
            let v = get(k).ok_or_else(|| {
                Error::Config(format!("Slurm: {k} is not set though SLURM_STEP_ID is"))
            })?;
            v.trim().parse().map_err(|_| {
                Error::Config(format!("Slurm: {k}={v:?} is not a non-negative integer"))
            })
        };
        let (tasks, nodes) = (num("SLURM_STEP_NUM_TASKS")?, num("SLURM_STEP_NUM_NODES")?);
        if tasks != nodes {
            return Err(Error::Config(format!(
                "Slurm: this step runs {tasks} tasks on {nodes} nodes, but accel launch starts \
                 the processes of its node itself and must run once per node: srun \
                 --ntasks-per-node=1 accel launch --num-processes K ..."
            )));
        }
        Ok(Some(Self {
            num_machines: nodes,
            machine_rank: num("SLURM_NODEID")?,
            main_process_ip: slurm_first_host(&get)?,
            main_process_port: slurm_job_port(&get),
        }))
    }
}

/// Rank 0's host under Slurm: the first of the step's (else the job's) host list.
fn slurm_first_host(get: &impl Fn(&str) -> Option<String>) -> Result<String> {
    let (name, list) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
        .into_iter()
        .find_map(|k| get(k).map(|v| (k, v)))
        .ok_or_else(|| {
            Error::Config(
                "Slurm: neither MASTER_ADDR nor SLURM_STEP_NODELIST is set, so rank 0's host is \
                 unknown: set MASTER_ADDR"
                    .into(),
            )
        })?;
    let mut hosts = expand_hostlist(&list).map_err(|why| {
        Error::Config(format!(
            "Slurm: {name}={list:?} is not a Slurm host list ({why}): set MASTER_ADDR to rank \
             0's host"
        ))
    })?;
    Ok(hosts.swap_remove(0))
}

/// The store's port from the job and step ids ([`slurm_port`]); torch's default outside a
/// job.
fn slurm_job_port(get: &impl Fn(&str) -> Option<String>) -> u16 {
    let id = |a: &str, b: &str| get(a).or_else(|| get(b)).and_then(|v| v.trim().parse().ok());
    match id("SLURM_JOB_ID", "SLURM_JOBID") {
        Some(job) => slurm_port(job, id("SLURM_STEP_ID", "SLURM_STEPID")),
        None => DEFAULT_PORT,
    }
}

/// The store's port for Slurm job `job`, step `step`: in 15000..32000 (below Linux's
/// ephemeral ports), different for the steps of one job and for neighbouring jobs.
pub fn slurm_port(job: u64, step: Option<u64>) -> u16 {
    let step = step.unwrap_or(0) % 17;
    15000 + ((job % 1000) * 17 + step) as u16
}

/// Tasks on node `node` from Slurm's `SLURM_STEP_TASKS_PER_NODE`: counts in node order,
/// `count(xREPEAT)` for runs, e.g. `2(x3),1`.
pub fn tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut first = 0usize;
    for part in spec.split(',') {
        let part = part.trim();
        let (count, repeat) = match part.split_once('(') {
            Some((count, rest)) => {
                let repeat = rest.strip_prefix('x')?.strip_suffix(')')?;
                (count.parse::<usize>().ok()?, repeat.parse::<usize>().ok()?)
            }
            None => (part.parse::<usize>().ok()?, 1),
        };
        if node < first + repeat {
            return Some(count);
        }
        first += repeat;
    }
    None
}

/// Expands a Slurm host list, `n[01-03,07],login1` → `n01 n02 n03 n07 login1`, as
/// `scontrol show hostnames` does (brackets in one name multiply, the last varying
/// fastest; zero padding kept).
pub fn expand_hostlist(list: &str) -> std::result::Result<Vec<String>, String> {
    const MAX_HOSTS: usize = 1 << 20;
    let mut hosts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    let bytes = list.as_bytes();
    let mut names = Vec::new();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'[' => depth += 1,
            b']' => depth = depth.checked_sub(1).ok_or("a ']' without its '['")?,
            b',' if depth == 0 => {
                names.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '[' without its ']'".into());
    }
    names.push(&list[start..]);
    for name in names.into_iter().map(str::trim).filter(|n| !n.is_empty()) {
        let mut expanded = vec![String::new()];
        let mut rest = name;
        while let Some(open) = rest.find('[') {
            let close = open + rest[open..].find(']').ok_or("a '[' without its ']'")?;
            let prefix = &rest[..open];
            let mut items = Vec::new();
            for range in rest[open + 1..close].split(',') {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                let (lo, hi) = (a.trim().parse::<u64>(), b.trim().parse::<u64>());
                let (Ok(lo), Ok(hi)) = (lo, hi) else {
                    return Err(format!("{range:?} is not a number or a range of numbers"));
                };
                if hi < lo || hi - lo >= MAX_HOSTS as u64 {
                    return Err(format!("{range:?} is not an increasing range"));
                }
                let width = a.trim().len();
                items.extend((lo..=hi).map(|n| format!("{n:0width$}")));
            }
            expanded = expanded
                .iter()
                .flat_map(|e| items.iter().map(move |i| format!("{e}{prefix}{i}")))
                .collect();
            if expanded.len() > MAX_HOSTS {
                return Err(format!("more than {MAX_HOSTS} hosts"));
            }
            rest = &rest[close + 1..];
        }
        hosts.extend(expanded.into_iter().map(|e| e + rest));
    }
    if hosts.is_empty() {
        return Err("no host".into());
    }
    Ok(hosts)
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
    fn slurm_variables_as_srun_sets_them() {
        // srun -N 2 -n 4 --ntasks-per-node 2, task 3 (second node), job 4242 step 1.
        let vars = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_STEP_NODELIST", "node[07-08]"),
            ("SLURM_JOB_NODELIST", "node[07-08]"),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "1"),
        ];
        let t = Topology::from_env_with(env(&vars)).unwrap();
        assert_eq!((t.rank, t.world_size, t.local_rank, t.local_world_size), (3, 4, 1, 2));
        assert_eq!((t.node_rank(), t.num_nodes(), t.source), (1, 2, "Slurm"));
        assert_eq!((t.master_addr.as_str(), t.master_port), ("node07", slurm_port(4242, Some(1))));
        assert_ne!(slurm_port(4242, Some(1)), slurm_port(4242, Some(2)));
        assert_ne!(slurm_port(4242, Some(1)), slurm_port(4243, Some(1)));
        assert!((15000..32768).contains(&slurm_port(u64::MAX, Some(u64::MAX))));
        // MASTER_ADDR / MASTER_PORT win over what Slurm's variables give.
        let mut given = vars.to_vec();
        given.extend([("MASTER_ADDR", "10.1.0.1"), ("MASTER_PORT", "1234")]);
        let t = Topology::from_env_with(env(&given)).unwrap();
        assert_eq!((t.master_addr.as_str(), t.master_port), ("10.1.0.1", 1234));
        // An uneven layout is refused with what srun needs.
        let mut uneven = vars.to_vec();
        uneven.retain(|(k, _)| *k != "SLURM_STEP_TASKS_PER_NODE");
        uneven.push(("SLURM_STEP_TASKS_PER_NODE", "3,1"));
        let e = Topology::from_env_with(env(&uneven)).unwrap_err().to_string();
        assert!(e.contains("--ntasks-per-node=K --distribution=block"), "{e}");
        // sbatch's script itself is one process, not task 0 of the job.
        let batch = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "h[1-2]"),
        ];
        let e = Topology::from_env_with(env(&batch)).unwrap_err().to_string();
        assert!(e.contains("the batch script of a job of 4 tasks"), "{e}");
        // Without srun's variables, a rank alone is not a run.
        let e = Topology::from_env_with(env(&[("SLURM_PROCID", "0")])).unwrap_err().to_string();
        assert!(e.contains("SLURM_NTASKS is not set") && e.contains("srun"), "{e}");
    }

    #[test]
    fn mpi_launchers_variables() {
        let t = Topology::from_env_with(env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
            ("SLURM_PROCID", "0"), // an allocation's leftovers: MPI's variables come first
        ]))
        .unwrap();
        assert_eq!((t.rank, t.world_size, t.source), (2, 3, "Open MPI"));
        assert_eq!((t.master_addr.as_str(), t.master_port), ("127.0.0.1", DEFAULT_PORT));
        let t = Topology::from_env_with(env(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ]))
        .unwrap();
        assert_eq!((t.rank, t.world_size, t.local_rank, t.source), (1, 2, 1, "MPICH / Intel MPI"));
        let t = Topology::from_env_with(env(&[
            ("MV2_COMM_WORLD_RANK", "3"),
            ("MV2_COMM_WORLD_SIZE", "4"),
            ("MV2_COMM_WORLD_LOCAL_RANK", "1"),
            ("MV2_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.9"),
        ]))
        .unwrap();
        assert_eq!((t.rank, t.node_rank(), t.source), (3, 1, "MVAPICH"));
        assert_eq!(t.master_addr, "10.0.0.9");
        // Across machines without MASTER_ADDR: which variable to set, and how.
        let e = Topology::from_env_with(env(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_ADDR is not set") && e.contains("-genv MASTER_ADDR"), "{e}");
        // Incomplete: a rank without its size is never a 1-process run.
        let e = Topology::from_env_with(env(&[("PMI_RANK", "1")])).unwrap_err().to_string();
        assert!(e.contains("PMI_SIZE is not set though PMI_RANK is"), "{e}");
        let e = Topology::from_env_with(env(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("MPI_LOCALRANKID is not set"), "{e}");
    }

    #[test]
    fn kubernetes_variables_mean_one_process_per_pod() {
        let t = Topology::from_env_with(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "job-master-0"),
            ("MASTER_PORT", "23456"),
        ]))
        .unwrap();
        assert_eq!((t.rank, t.world_size, t.local_rank, t.local_world_size), (1, 2, 0, 1));
        assert_eq!((t.node_rank(), t.num_nodes()), (1, 2));
        let e = Topology::from_env_with(env(&[("RANK", "1"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_ADDR is not set"), "{e}");
    }

    #[test]
    fn a_launcher_seen_but_not_read_is_an_error() {
        assert_eq!(Topology::from_env_with(env(&[])).unwrap(), Topology::single());
        for var in UNREAD {
            let e = Topology::from_env_with(env(&[(var, "1")])).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{var} is set")) && e.contains("RANK and WORLD_SIZE"),
                "{e}"
            );
        }
        let e = Topology::from_env_with(env(&[("WORLD_SIZE", "2")])).unwrap_err().to_string();
        assert!(e.contains("RANK is not set though WORLD_SIZE=2 is"), "{e}");
        let t = Topology::from_env_with(env(&[("WORLD_SIZE", "1")])).unwrap();
        assert_eq!((t.rank, t.world_size), (0, 1));
        let e = Topology::from_env_with(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("LOCAL_WORLD_SIZE is not set though LOCAL_RANK is"), "{e}");
    }

    #[test]
    fn srun_accel_launch_takes_its_machines_from_slurm() {
        let step = [
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_ID", "77"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_STEP_NODELIST", "h[1-2]"),
        ];
        let m = SlurmMachines::from_env_with(env(&step)).unwrap().unwrap();
        assert_eq!((m.num_machines, m.machine_rank, m.main_process_ip.as_str()), (2, 1, "h1"));
        assert_eq!(m.main_process_port, slurm_port(77, Some(0)));
        assert_eq!(SlurmMachines::from_env_with(env(&[])).unwrap(), None);
        let mut two_per_node = step.to_vec();
        two_per_node[4] = ("SLURM_STEP_NUM_TASKS", "4");
        let e = SlurmMachines::from_env_with(env(&two_per_node)).unwrap_err().to_string();
        assert!(e.contains("--ntasks-per-node=1 accel launch"), "{e}");
    }

    #[test]
    fn slurm_host_lists_expand_as_scontrol_does() {
        let hosts = |l: &str| expand_hostlist(l).unwrap().join(" ");
        assert_eq!(hosts("n[01-03,07],login1"), "n01 n02 n03 n07 login1");
        assert_eq!(hosts("gpu-a[8-10]"), "gpu-a8 gpu-a9 gpu-a10");
        assert_eq!(hosts("rack[1-2]-n[1-2]"), "rack1-n1 rack1-n2 rack2-n1 rack2-n2");
        assert_eq!(hosts("single"), "single");
        for bad in ["n[1-", "n]1[", "n[3-1]", "n[a-b]", ""] {
            assert!(expand_hostlist(bad).is_err(), "{bad}");
        }
        assert_eq!(tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on_node("2(x3),1", 4), None);
        assert_eq!(tasks_on_node("4", 0), Some(4));
        assert_eq!(tasks_on_node("x", 0), None);
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
        assert!(e.contains("WORLD_SIZE is not set though RANK is"), "{e}");
    }
}
