//! Setting up a [`TcpGroup`]: the rendezvous, one TCP connection per pair of ranks (the higher
//! rank connects to the lower) introduced by a handshake (magic, version, world size, rank,
//! round), and the fast failure of an address a peer cannot use.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::accept::Acceptor;
use super::dial::{Setup, context};
use super::wire::Peer;
use super::{SOCKET_IFNAME_VAR, TcpGroup};
use crate::auth::JobIdentity;
use crate::error::{CommError, Result};
use crate::group::call::Calls;
use crate::rendezvous::{Rendezvous, rendezvous};
use crate::topology::Topology;

/// Options of [`TcpGroup::connect`].
#[derive(Debug, Clone)]
pub struct TcpGroupOptions {
    /// How long the rendezvous and the connection set-up may take (default 300 s).
    pub connect_timeout: Duration,
    /// The job this process belongs to (its run id and key); `None` (the default): from the
    /// environment ([`JobIdentity::from_env`]), with `tcp-MASTER_ADDR:MASTER_PORT` as the run id
    /// when neither `BURN_DDP_RUN_ID` nor a scheduler gives one.
    pub job: Option<JobIdentity>,
}

impl Default for TcpGroupOptions {
    fn default() -> Self {
        Self {
            connect_timeout: crate::rendezvous::DEFAULT_RENDEZVOUS_TIMEOUT,
            job: None,
        }
    }
}

/// The run id of a process group that meets through the store at `topology`'s address when no
/// `BURN_DDP_RUN_ID` or scheduler names one (every rank computes the same).
pub(crate) fn default_run_id(topology: &Topology) -> String {
    format!(
        "tcp-{}",
        crate::store::host_port(&topology.master_addr, topology.master_port)
    )
}

/// Before the group forms, on every rank: a job without a secret is open to anyone who reaches
/// its ports, and one without a run id of its own (derived from the store's address) is not kept
/// apart from another job started by hand on the same address either.
fn warn_if_open(job: &JobIdentity, topology: &Topology, from_env: bool) {
    if job.secret() != crate::auth::Secret::None {
        return;
    }
    let store = crate::store::host_port(&topology.master_addr, topology.master_port);
    let named = !from_env || crate::auth::run_id_from_env().is_some();
    crate::log::warn_console(&format!(
        "rank {}: no job token ({}): the rendezvous store at {store} and this rank's port accept \
         any process that reaches them{}; set {} to the same secret on every process of the job \
         (`openssl rand -hex 32`; burn-ddp run makes one by itself on one node)",
        topology.rank,
        crate::auth::JOB_TOKEN_VAR,
        if named {
            String::new()
        } else {
            format!(
                ", and the run id `{}` comes from that address alone, so another job started by \
                 hand there is taken for this one (set {} too)",
                job.run_id(),
                crate::auth::RUN_ID_VAR
            )
        },
        crate::auth::JOB_TOKEN_VAR,
    ));
}

impl TcpGroup {
    /// Joins the job described by the environment (see [`Topology::from_env`]).
    ///
    /// # Errors
    /// [`CommError::Topology`] when the environment does not describe a multi-process job, and
    /// the errors of [`connect`](Self::connect).
    pub fn from_env(options: &TcpGroupOptions) -> Result<TcpGroup> {
        let topology = Topology::from_env()?.ok_or_else(|| {
            CommError::Topology(
                "this process is not part of a multi-process job: set RANK, WORLD_SIZE, \
                 MASTER_ADDR and MASTER_PORT (or start it with `burn-ddp run`, srun or mpirun)"
                    .into(),
            )
        })?;
        Self::connect(&topology, options)
    }

    /// Meets the other processes of `topology` through the rendezvous store and connects to
    /// each of them: this rank dials every lower rank and accepts every higher one, each
    /// connection introduced by the job's handshake.
    ///
    /// # Errors
    /// The rendezvous' errors ([`CommError::Rendezvous`], [`CommError::Store`]);
    /// [`CommError::Connect`] when a peer cannot be reached or answers with a wrong handshake.
    pub fn connect(topology: &Topology, options: &TcpGroupOptions) -> Result<TcpGroup> {
        let (rank, world_size) = (topology.rank, topology.world_size);
        if topology.master_addr.is_empty() {
            return Err(CommError::Topology(
                "MASTER_ADDR is not set: a TcpGroup meets through a store at MASTER_ADDR \
                 (under mpirun/srun, the `mpi` feature's MpiGroup needs none)"
                    .into(),
            ));
        }
        let started = Instant::now();
        let interface = listen_interface(rank)?;
        let job = match &options.job {
            Some(job) => job.clone(),
            None => JobIdentity::from_env(&default_run_id(topology))?,
        };
        warn_if_open(&job, topology, options.job.is_none());
        let (rendezvous, listener, listen_addr) = meet(topology, options, &job, interface)?;
        let setup = Setup {
            topology,
            job: &job,
            mine: context(rank, world_size, topology.restart_count),
            deadline: started.checked_add(options.connect_timeout),
            connect_timeout: options.connect_timeout,
            rendezvous: &rendezvous,
        };
        let mut peers: Vec<Option<Peer>> = (0..world_size).map(|_| None).collect();
        for (peer, addr) in rendezvous.peer_addrs.iter().enumerate().take(rank) {
            peers[peer] = Some(setup.dial(peer, addr)?);
        }
        Acceptor::new(&setup, listener, listen_addr)?.accept_higher(&mut peers)?;
        tracing::info!(
            "burn-ddp: rank {rank} of {world_size} connected over TCP in {:.2} s",
            started.elapsed().as_secs_f64()
        );
        Ok(TcpGroup {
            rank,
            world_size,
            calls: Calls::default(),
            peers,
            rendezvous: Some(rendezvous),
            abort_polled: Mutex::new(None),
            scratch: Mutex::new(Vec::new()),
        })
    }
}

/// The address of the interface `BURN_DDP_SOCKET_IFNAME` names, when it names one.
fn listen_interface(rank: usize) -> Result<Option<std::net::IpAddr>> {
    match std::env::var(SOCKET_IFNAME_VAR) {
        Ok(name) if !name.is_empty() => {
            interface_ip(&name)
                .map(Some)
                .map_err(|detail| CommError::Connect {
                    rank,
                    peer: rank,
                    addr: format!("{SOCKET_IFNAME_VAR}={name}"),
                    detail,
                })
        }
        _ => Ok(None),
    }
}

/// The rendezvous of `topology`'s job, and the listener this rank published there: on the
/// address this host uses to reach the store (a peer that reaches the store reaches it too, in
/// the same address family), or on `interface` (the one `BURN_DDP_SOCKET_IFNAME` names).
fn meet(
    topology: &Topology,
    options: &TcpGroupOptions,
    job: &JobIdentity,
    interface: Option<std::net::IpAddr>,
) -> Result<(Rendezvous, TcpListener, String)> {
    let rank = topology.rank;
    let mut listening = None;
    let rendezvous = rendezvous(topology, options.connect_timeout, job, |store_ip| {
        let ip = interface.unwrap_or(store_ip);
        let cannot = |detail: String| CommError::Connect {
            rank,
            peer: rank,
            addr: format!("{ip}:0"),
            detail,
        };
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| cannot(format!("cannot listen: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| cannot(e.to_string()))?
            .to_string();
        listening = Some((listener, addr.clone()));
        Ok(addr)
    })?;
    let Some((listener, listen_addr)) = listening else {
        return Err(CommError::Rendezvous {
            rank,
            detail: "the rendezvous finished without a listening address".into(),
        });
    };
    Ok((rendezvous, listener, listen_addr))
}

/// The IPv4 (else IPv6) address of the network interface `name`.
#[cfg(unix)]
fn interface_ip(name: &str) -> std::result::Result<std::net::IpAddr, String> {
    use std::ffi::CStr;
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `getifaddrs` fills `list` with a linked list we free below with `freeifaddrs`.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(format!(
            "cannot list the network interfaces: {}",
            io::Error::last_os_error()
        ));
    }
    let mut found: Option<std::net::IpAddr> = None;
    let mut names: Vec<String> = Vec::new();
    let mut cursor = list;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a node of the list `getifaddrs` returned, not yet freed.
        let entry = unsafe { &*cursor };
        cursor = entry.ifa_next;
        if entry.ifa_name.is_null() || entry.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: `ifa_name` is a NUL-terminated string owned by the list.
        let entry_name = unsafe { CStr::from_ptr(entry.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `ifa_addr` points to a sockaddr whose family says which struct it is.
        let ip = unsafe {
            match i32::from((*entry.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let v4 = &*(entry.ifa_addr as *const libc::sockaddr_in);
                    Some(std::net::IpAddr::from(
                        u32::from_be(v4.sin_addr.s_addr).to_be_bytes(),
                    ))
                }
                libc::AF_INET6 => {
                    let v6 = &*(entry.ifa_addr as *const libc::sockaddr_in6);
                    Some(std::net::IpAddr::from(v6.sin6_addr.s6_addr))
                }
                _ => None,
            }
        };
        if !names.contains(&entry_name) {
            names.push(entry_name.clone());
        }
        if entry_name == name
            && let Some(ip) = ip
            && (found.is_none() || ip.is_ipv4())
            && !found.is_some_and(|f| f.is_ipv4())
        {
            found = Some(ip);
        }
    }
    // SAFETY: frees the list `getifaddrs` allocated; no reference into it outlives this call.
    unsafe { libc::freeifaddrs(list) };
    found.ok_or_else(|| {
        format!(
            "no interface {name} with an IP address (interfaces: {})",
            names.join(", ")
        )
    })
}

#[cfg(not(unix))]
fn interface_ip(name: &str) -> std::result::Result<std::net::IpAddr, String> {
    Err(format!(
        "{SOCKET_IFNAME_VAR}={name}: interfaces are only looked up on Unix"
    ))
}
