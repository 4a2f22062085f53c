//! The store's server: the table, the accept loop, the sessions and their limits.

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::{
    ALIVE_EVERY, ENTRY_OVERHEAD, HANDSHAKE_DEADLINE, LAUNCHER_PREFIX, LOG_EVERY, MAX_ENTRIES,
    MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE, MAX_KEY, MAX_SESSIONS, MAX_TABLE, MAX_VALUE,
    MAX_WAIT, OP_ADD, OP_CHECK, OP_GET, OP_SET, OP_WAIT, REQUEST_DEADLINE, STATUS_OK,
    STATUS_REFUSED, STATUS_TIMEOUT, STORE_BIND_VAR, put_bytes, read_bytes, read_keys, read_string,
    read_u8, read_u64, store_error,
};
use crate::auth::{self, JobIdentity, Role, Service};
use crate::error::Result;
use crate::gate::{Gate, Pass, RateLimited, printable};

/// The keys and values, and how many bytes they take.
#[derive(Default)]
pub(super) struct Entries {
    pub(super) map: HashMap<String, Vec<u8>>,
    pub(super) bytes: usize,
}

impl Entries {
    /// Books `key` holding `value_len` bytes (replacing what it held), unless the table would
    /// grow past [`MAX_TABLE`] bytes or [`MAX_ENTRIES`] keys.
    pub(super) fn charge(
        &mut self,
        key: &str,
        value_len: usize,
    ) -> std::result::Result<(), String> {
        let cost = |value: usize| key.len() + value + ENTRY_OVERHEAD;
        let old = self.map.get(key).map(|v| cost(v.len()));
        if old.is_none() && self.map.len() >= MAX_ENTRIES {
            return Err(format!(
                "the store holds at most {MAX_ENTRIES} keys; `{key}` would be one more"
            ));
        }
        let bytes = self.bytes - old.unwrap_or(0) + cost(value_len);
        if bytes > MAX_TABLE {
            return Err(format!(
                "the store holds at most {MAX_TABLE} bytes; setting `{key}` would make it {bytes}"
            ));
        }
        self.bytes = bytes;
        Ok(())
    }
}

#[derive(Default)]
struct Table {
    entries: Mutex<Entries>,
    changed: Condvar,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sets `key` to `value`, unless the table would grow past [`MAX_TABLE`].
    fn insert(&self, key: String, value: Vec<u8>) -> std::result::Result<(), String> {
        let mut entries = self.lock();
        entries.charge(&key, value.len())?;
        entries.map.insert(key, value);
        drop(entries);
        self.changed.notify_all();
        Ok(())
    }

    /// Waits until every key exists, `timeout` passes (at most [`MAX_WAIT`]) or `alive` says the
    /// client left (asked every [`ALIVE_EVERY`]); returns the missing keys.
    fn wait_for(
        &self,
        keys: &[String],
        timeout: Duration,
        alive: &mut dyn FnMut() -> bool,
    ) -> Vec<String> {
        let deadline = Instant::now() + timeout.min(MAX_WAIT);
        let mut entries = self.lock();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !entries.map.contains_key(*k))
                .cloned()
                .collect();
            let now = Instant::now();
            if missing.is_empty() || now >= deadline {
                return missing;
            }
            entries = self
                .changed
                .wait_timeout(entries, (deadline - now).min(ALIVE_EVERY))
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
            if Instant::now() < deadline {
                drop(entries);
                if !alive() {
                    return missing;
                }
                entries = self.lock();
            }
        }
    }
}

/// The store server. Accepts the job's processes until dropped; connected ones are served until
/// they disconnect.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<thread::JoinHandle<()>>,
    job: Arc<JobIdentity>,
    /// Connections being served.
    #[cfg_attr(not(test), allow(dead_code))]
    sessions: Arc<AtomicUsize>,
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port, see [`local_addr`](Self::local_addr)) and
    /// serves the processes of `job` (each connection proves it with the job's handshake) on
    /// background threads. Bind the address the store is reached at (`MASTER_ADDR`), not every
    /// interface: [`bind_address`] gives it.
    ///
    /// # Errors
    /// [`CommError::Store`](crate::CommError::Store) when the port is already in use or cannot be bound.
    pub fn bind(addr: SocketAddr, job: &JobIdentity) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            let detail = if e.kind() == io::ErrorKind::AddrInUse {
                format!(
                    "port {} is already in use on {} (another job or a process left over from \
                     an earlier run?): choose another MASTER_PORT",
                    addr.port(),
                    addr.ip()
                )
            } else {
                e.to_string()
            };
            store_error(&addr.to_string(), "bind", detail)
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| store_error(&addr.to_string(), "bind", e.to_string()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| store_error(&addr.to_string(), "bind", e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let job = Arc::new(job.clone());
        let sessions = Arc::new(AtomicUsize::new(0));
        let served = Served {
            table: Arc::new(Table::default()),
            job: job.clone(),
            handshaking: Gate::new(MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE),
            refusals: Arc::new(Mutex::new(RateLimited::new(LOG_EVERY))),
            sessions: sessions.clone(),
            session_limit: session_limit(),
        };
        let accept_stop = stop.clone();
        let accept = thread::Builder::new()
            .name("burn-ddp-store".into())
            .spawn(move || accept_loop(listener, served, accept_stop))
            .map_err(|e| store_error(&addr.to_string(), "bind", e.to_string()))?;
        tracing::debug!("burn-ddp: store serving on {local}");
        Ok(StoreServer {
            addr: local,
            stop,
            accept: Some(accept),
            job,
            sessions,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The job whose processes it serves.
    pub fn job(&self) -> &JobIdentity {
        &self.job
    }

    /// Connections being served now (after their handshake).
    #[cfg(test)]
    pub(super) fn sessions(&self) -> usize {
        self.sessions.load(Ordering::Relaxed)
    }
}

/// The address a store reached at `host:port` binds: `BURN_DDP_STORE_BIND` when set (an IP
/// address, e.g. `0.0.0.0` for every interface), else the address `host` resolves to (loopback
/// for a single-node job on 127.0.0.1). Every interface of the address's family instead when
/// that address cannot serve the job: a loopback address in a job that spans `several_nodes`
/// (a host name that `/etc/hosts` maps to 127.0.1.1, say: the other nodes reach the store
/// through another name), or an address that is not this host's (a cloud machine's public
/// address, translated before it arrives).
///
/// # Errors
/// [`CommError::Store`](crate::CommError::Store) when `BURN_DDP_STORE_BIND` is not an IP address or `host` does not
/// resolve.
pub fn bind_address(host: &str, port: u16, several_nodes: bool) -> Result<SocketAddr> {
    if let Ok(bind) = std::env::var(STORE_BIND_VAR)
        && !bind.is_empty()
    {
        let ip: std::net::IpAddr = bind.trim_matches(['[', ']']).parse().map_err(|e| {
            store_error(
                &format!("{STORE_BIND_VAR}={bind}"),
                "bind",
                format!("not an IP address: {e}"),
            )
        })?;
        return Ok(SocketAddr::new(ip, port));
    }
    let target = host_port(host, port);
    let ip = target
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .ok_or_else(|| {
            store_error(
                &target,
                "bind",
                format!("MASTER_ADDR {host} does not resolve"),
            )
        })?
        .ip();
    let every_interface = match ip {
        std::net::IpAddr::V4(_) => std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        std::net::IpAddr::V6(_) => std::net::IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    };
    let unreachable_loopback = ip.is_loopback() && several_nodes;
    // A probe on a port the system picks: an address of another host cannot be bound.
    let not_ours = std::net::TcpListener::bind(SocketAddr::new(ip, 0))
        .is_err_and(|e| e.kind() == std::io::ErrorKind::AddrNotAvailable);
    Ok(SocketAddr::new(
        if unreachable_loopback || not_ours {
            every_interface
        } else {
            ip
        },
        port,
    ))
}

/// `host:port`, with an IPv6 address in brackets (`[::1]:29500`).
pub fn host_port(host: &str, port: u16) -> String {
    let host = host.trim_matches(['[', ']']);
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // The listening socket closes with the accept thread (within its 20 ms poll), so the
        // port can be bound again once the server is dropped.
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

/// What every connection of a server shares.
#[derive(Clone)]
struct Served {
    table: Arc<Table>,
    job: Arc<JobIdentity>,
    /// Connections in their handshake.
    handshaking: Gate,
    /// Refused handshakes and sessions: logged at most once per [`LOG_EVERY`].
    refusals: Arc<Mutex<RateLimited>>,
    /// Connections being served.
    sessions: Arc<AtomicUsize>,
    /// Connections served at most at once: [`MAX_SESSIONS`], fewer when the process may open
    /// fewer files.
    session_limit: usize,
}

/// Connections the store may serve at once: [`MAX_SESSIONS`], or half the files this process may
/// open (`RLIMIT_NOFILE`, raised to its hard limit when it can be) less the handshakes', so the
/// store never takes the descriptors training needs.
fn session_limit() -> usize {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `getrlimit` and `setrlimit` read and write the one struct given.
        let soft = unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return MAX_SESSIONS;
            }
            if limit.rlim_cur < limit.rlim_max {
                let raised = libc::rlimit {
                    rlim_cur: limit.rlim_max,
                    rlim_max: limit.rlim_max,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                    limit.rlim_cur = limit.rlim_max;
                }
            }
            limit.rlim_cur
        };
        let half = usize::try_from(soft / 2).unwrap_or(usize::MAX);
        half.saturating_sub(MAX_HANDSHAKES).clamp(1, MAX_SESSIONS)
    }
    #[cfg(not(unix))]
    MAX_SESSIONS
}

/// Decrements a counter when dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Takes one of `limit` slots of `counter`, if one is free.
fn take_slot(counter: &Arc<AtomicUsize>, limit: usize) -> Option<Slot> {
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            (n < limit).then_some(n + 1)
        })
        .ok()
        .map(|_| Slot(counter.clone()))
}

fn accept_loop(listener: TcpListener, served: Served, stop: Arc<AtomicBool>) {
    let mut busy_log = RateLimited::new(LOG_EVERY);
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut stream, from)) => {
                // Handshakes run off this loop, a bounded number at once and from one address:
                // idle or slow connections cannot hold the door shut for the job's own
                // processes (a client told "busy" tries again).
                let slot = match served.handshaking.enter(from.ip()) {
                    Ok(slot) => slot,
                    Err(full) => {
                        auth::refuse_busy(&mut stream);
                        if let Some(left_out) = busy_log.allow() {
                            tracing::warn!(
                                "burn-ddp: store: closing the connection from {from} at once: \
                                 {full} ({left_out} more closed since the last such line)"
                            );
                        }
                        continue;
                    }
                };
                let served = served.clone();
                let _ = thread::Builder::new()
                    .name("burn-ddp-store-client".into())
                    .spawn(move || serve(stream, from, slot, &served));
            }
            // Woken by the next connection; the stop flag is read every 20 ms.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                crate::net::wait_for_connection(&listener, Duration::from_millis(20));
            }
            Err(e) => {
                // Out of file descriptors (EMFILE, ENFILE) or another failure: named, at most
                // once per LOG_EVERY, and tried again after a pause.
                if let Some(left_out) = busy_log.allow() {
                    tracing::error!(
                        "burn-ddp: store: cannot accept connections: {e} ({left_out} more such \
                         failures since the last line; out of file descriptors? the process's \
                         limit is RLIMIT_NOFILE, `ulimit -n`)"
                    );
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Authenticates one client, then serves it until it disconnects. Dropping the [`StoreServer`]
/// only stops accepting new clients: connected ones keep being served, so the process serving
/// the store may finish its own rendezvous before the others have read the last keys.
fn serve(mut stream: TcpStream, from: SocketAddr, handshake: Pass, served: &Served) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let accepted = auth::accept(
        &mut stream,
        &served.job,
        Service::Store,
        b"",
        HANDSHAKE_DEADLINE,
    );
    drop(handshake);
    let refused = |why: &str| {
        let allowed = served.refusals.lock().map_or(None, |mut l| l.allow());
        if let Some(left_out) = allowed {
            tracing::warn!(
                "burn-ddp: store: refused the connection from {from}: {} ({left_out} more \
                 refused since the last such line)",
                printable(why)
            );
        }
    };
    let role = match accepted {
        Ok(accepted) => accepted.role,
        Err(why) => return refused(&why.to_string()),
    };
    let Some(_session) = take_slot(&served.sessions, served.session_limit) else {
        return refused(&format!(
            "{} connections are served already",
            served.session_limit
        ));
    };
    let _ = stream.set_write_timeout(Some(REQUEST_DEADLINE));
    while serve_one(&mut stream, &served.table, role).is_ok() {}
}

/// The reply refusing a request, with why.
fn refused(why: &str) -> Vec<u8> {
    let mut reply = vec![STATUS_REFUSED];
    put_bytes(&mut reply, why.as_bytes());
    reply
}

fn serve_one(stream: &mut TcpStream, table: &Table, role: Role) -> io::Result<()> {
    // A member may stay idle between requests; once one begins it must arrive whole in time.
    stream.set_read_timeout(None)?;
    let op = read_u8(stream)?;
    stream.set_read_timeout(Some(REQUEST_DEADLINE))?;
    let may_write = |key: &str| role == Role::Launcher || !key.starts_with(LAUNCHER_PREFIX);
    let mut reply = Vec::new();
    match op {
        OP_SET => {
            let key = read_string(stream, MAX_KEY)?;
            let value = read_bytes(stream, MAX_VALUE)?;
            if !may_write(&key) {
                reply = refused(&format!("`{key}` is written by launchers only"));
            } else if let Err(why) = table.insert(key, value) {
                reply = refused(&why);
            } else {
                reply.push(STATUS_OK);
            }
        }
        OP_GET => {
            let key = read_string(stream, MAX_KEY)?;
            let timeout = Duration::from_millis(read_u64(stream)?);
            if table
                .wait_for(std::slice::from_ref(&key), timeout, &mut || {
                    still_there(stream)
                })
                .is_empty()
            {
                let value = table.lock().map.get(&key).cloned().unwrap_or_default();
                reply.push(STATUS_OK);
                put_bytes(&mut reply, &value);
            } else {
                reply.push(STATUS_TIMEOUT);
            }
        }
        OP_ADD => {
            let key = read_string(stream, MAX_KEY)?;
            let delta = read_u64(stream)? as i64;
            if delta != 0 && !may_write(&key) {
                reply = refused(&format!("`{key}` is written by launchers only"));
            } else {
                // Read and write under one lock: concurrent adds must not lose a count. An add
                // of 0 only reads.
                let mut entries = table.lock();
                let current = entries
                    .map
                    .get(&key)
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                    .unwrap_or(0);
                let next = current.wrapping_add(delta);
                let text = next.to_string().into_bytes();
                let booked = match delta {
                    0 => Ok(()),
                    _ => entries.charge(&key, text.len()),
                };
                match booked {
                    Ok(()) => {
                        if delta != 0 {
                            entries.map.insert(key, text);
                        }
                        drop(entries);
                        table.changed.notify_all();
                        reply.push(STATUS_OK);
                        reply.extend_from_slice(&(next as u64).to_le_bytes());
                    }
                    Err(why) => reply = refused(&why),
                }
            }
        }
        OP_CHECK => {
            let keys = read_keys(stream)?;
            let entries = table.lock();
            reply.push(STATUS_OK);
            reply.extend(keys.iter().map(|k| u8::from(entries.map.contains_key(k))));
        }
        OP_WAIT => {
            let keys = read_keys(stream)?;
            let timeout = Duration::from_millis(read_u64(stream)?);
            let missing = table.wait_for(&keys, timeout, &mut || still_there(stream));
            if missing.is_empty() {
                reply.push(STATUS_OK);
            } else {
                reply.push(STATUS_TIMEOUT);
                put_bytes(&mut reply, missing.join("\n").as_bytes());
            }
        }
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unknown store operation {op}"),
            ));
        }
    }
    stream.write_all(&reply)
}

/// Whether the client of a parked session is still connected (it sends nothing while it waits:
/// a closed connection reads as the end of the stream).
fn still_there(stream: &mut TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let there = match stream.peek(&mut [0u8; 1]) {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted,
    };
    stream.set_nonblocking(false).is_ok() && there
}
