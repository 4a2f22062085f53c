//! The rendezvous store: a small TCP key-value server, the counterpart of PyTorch's `TCPStore`.
//!
//! Rank 0 (or the launcher) serves it at `MASTER_ADDR:MASTER_PORT`, bound to that address only
//! (`BURN_DDP_STORE_BIND` overrides it); every process connects as a client. Keys are strings,
//! values bytes. Operations, each with a timeout:
//! - [`set`](StoreClient::set) a value;
//! - [`get`](StoreClient::get) a value, waiting until some process has set it;
//! - [`add`](StoreClient::add) to a counter (stored as decimal text) and read the new value;
//! - [`check`](StoreClient::check) which of some keys exist, without waiting;
//! - [`wait`](StoreClient::wait) until all of some keys exist.
//!
//! **Only the job's processes.** Every connection starts with the job's challenge-response
//! ([`auth`](crate::mechanism::auth)): a process of another run is refused naming both run ids, a
//! stranger is refused and learns nothing. Keys under `burn-ddp/launcher/` (the restart round)
//! are written by launchers only. **Bounded.** At most 64 connections may be in their handshake
//! (5 s each, off the accept loop) and 4096 served; a request must arrive whole within 10 s once
//! begun; keys are at most 1 KiB, values 1 MiB, the table 64 MiB, a request 65,536 keys.
//!
//! Wire format after the handshake (all integers little-endian): a request is an operation byte
//! followed by its fields, a string or byte field being a `u32` length then the bytes; a reply is
//! a status byte (0 ok, 1 timeout, 2 refused followed by why) followed by the result.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::auth::{self, JobIdentity, Role, Service};
use crate::error::{DdpError, Result};
use crate::gate::{Gate, Pass, RateLimited, printable};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_WAIT: u8 = 5;

const STATUS_OK: u8 = 0;
const STATUS_TIMEOUT: u8 = 1;
const STATUS_REFUSED: u8 = 2;

/// Largest key accepted (1 KiB).
const MAX_KEY: usize = 1 << 10;
/// Largest value accepted (1 MiB: the largest burn-ddp stores is an address or NCCL's 128-byte
/// id).
const MAX_VALUE: usize = 1 << 20;
/// Largest table (keys, values and each entry's bookkeeping together: 64 MiB).
const MAX_TABLE: usize = 64 << 20;
/// What an entry costs beyond its key's and value's bytes (the map's slot, two allocations), so
/// that a table of tiny entries is bounded by the memory it takes.
const ENTRY_OVERHEAD: usize = 96;
/// Most keys the table holds (a job of the most ranks, 65,536, needs a few per rank and round;
/// with their overhead they stay below `MAX_TABLE`).
const MAX_ENTRIES: usize = 1 << 19;
/// Most bytes of keys in one request.
const MAX_REQUEST_KEY_BYTES: usize = 4 << 20;
/// The longest a GET or WAIT parks a session: a client that waits longer asks again (and a
/// client that left is noticed every [`ALIVE_EVERY`]).
const MAX_WAIT: Duration = Duration::from_secs(600);
/// How often a parked session looks whether its client is still there.
const ALIVE_EVERY: Duration = Duration::from_secs(1);
/// Most keys in one request.
pub(crate) const MAX_KEYS: usize = 1 << 16;
/// Connections at most in their handshake at once (more are closed at once).
const MAX_HANDSHAKES: usize = 64;
/// Connections in their handshake at once from one address (the job's ranks on one node share
/// theirs; a client told "busy" tries again).
const MAX_HANDSHAKES_PER_SOURCE: usize = 16;
/// At most one line of a kind of refusal in this long (with the count of those left out).
const LOG_EVERY: Duration = Duration::from_secs(10);
/// Connections served at most at once.
const MAX_SESSIONS: usize = 4096;
/// How long a connection has for its handshake.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// How long the rest of a request may take to arrive once its first byte came.
const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
/// Keys only launchers may write (the restart round).
pub(crate) const LAUNCHER_PREFIX: &str = "burn-ddp/launcher/";

/// The variable that overrides the address the store binds (default: the address it is reached
/// at, `MASTER_ADDR`).
pub const STORE_BIND_VAR: &str = "BURN_DDP_STORE_BIND";

/// The keys and values, and how many bytes they take.
#[derive(Default)]
struct Entries {
    map: HashMap<String, Vec<u8>>,
    bytes: usize,
}

impl Entries {
    /// Books `key` holding `value_len` bytes (replacing what it held), unless the table would
    /// grow past [`MAX_TABLE`] bytes or [`MAX_ENTRIES`] keys.
    fn charge(&mut self, key: &str, value_len: usize) -> std::result::Result<(), String> {
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
    /// [`DdpError::Store`] when the port is already in use or cannot be bound.
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
    fn sessions(&self) -> usize {
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
/// [`DdpError::Store`] when `BURN_DDP_STORE_BIND` is not an IP address or `host` does not
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

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// A length-prefixed field of at most `max` bytes (checked before anything is allocated).
fn read_bytes(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a field of {len} bytes, more than {max}"),
        ));
    }
    let mut value = vec![0u8; len];
    r.read_exact(&mut value)?;
    Ok(value)
}

fn read_string(r: &mut impl Read, max: usize) -> io::Result<String> {
    String::from_utf8(read_bytes(r, max)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))
}

fn read_keys(r: &mut impl Read) -> io::Result<Vec<String>> {
    let mut count = [0u8; 4];
    r.read_exact(&mut count)?;
    let count = u32::from_le_bytes(count) as usize;
    if count > MAX_KEYS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{count} keys in one request, more than {MAX_KEYS}"),
        ));
    }
    let mut total = 0;
    (0..count)
        .map(|_| {
            let key = read_string(r, MAX_KEY)?;
            total += key.len();
            if total > MAX_REQUEST_KEY_BYTES {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("more than {MAX_REQUEST_KEY_BYTES} bytes of keys in one request"),
                ));
            }
            Ok(key)
        })
        .collect()
}

/// Appends a length-prefixed field. Callers keep fields under [`MAX_VALUE`] (checked in
/// [`StoreClient::set`]), so the length fits in a `u32`.
fn put_bytes(out: &mut Vec<u8>, value: &[u8]) {
    out.extend_from_slice(&(value.len().min(u32::MAX as usize) as u32).to_le_bytes());
    out.extend_from_slice(value);
}

fn put_keys(out: &mut Vec<u8>, keys: &[&str]) {
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for key in keys {
        put_bytes(out, key.as_bytes());
    }
}

/// What a failed handshake with the store at `addr` means, for a process of `job`.
fn refusal(why: &auth::Refusal, job: &JobIdentity) -> String {
    match why {
        auth::Refusal::OtherRun { theirs } => format!(
            "the store there belongs to run {theirs}, this process to run {}: two jobs share \
             MASTER_ADDR:MASTER_PORT (give each job its own MASTER_PORT), or the processes of one \
             job were given different BURN_DDP_RUN_ID values",
            job.run_id()
        ),
        auth::Refusal::NotBurnDdp(what) => format!(
            "the service at this address is not a burn-ddp rendezvous store ({what}): is \
             MASTER_PORT the port of another service?"
        ),
        other => other.to_string(),
    }
}

fn store_error(addr: &str, op: &str, detail: String) -> DdpError {
    DdpError::Store {
        addr: addr.to_string(),
        op: op.to_string(),
        detail,
    }
}

/// A connection to the store.
pub struct StoreClient {
    addr: String,
    stream: Mutex<TcpStream>,
    local_ip: std::net::IpAddr,
    /// Set after an I/O error or a reply that did not come: a late reply would otherwise be read
    /// as the answer to the next request.
    broken: AtomicBool,
}

/// Extra time a client waits for a reply beyond the operation's own timeout (network latency).
const REPLY_SLACK: Duration = Duration::from_secs(10);

impl StoreClient {
    /// Connects to the store at `addr` (`host:port`, an IPv6 address in brackets) as a process
    /// of `job` in `role`, retrying until `timeout` passes, since the server may start after the
    /// clients. The handshake proves the job's key both ways.
    ///
    /// # Errors
    /// [`DdpError::Store`] when no store answers at `addr` within `timeout`, `addr` does not
    /// resolve, the service at `addr` is not a burn-ddp store (naming what it is), the store
    /// belongs to another run (naming both run ids), or either side does not hold the job's key.
    pub fn connect(
        addr: &str,
        timeout: Duration,
        job: &JobIdentity,
        role: Role,
    ) -> Result<StoreClient> {
        let deadline = Instant::now().checked_add(timeout);
        let mut last_error = String::from("no address");
        loop {
            // Resolve on every try: a host name may appear in DNS after the job started.
            let resolved: Vec<SocketAddr> = match addr.to_socket_addrs() {
                Ok(resolved) => resolved.collect(),
                Err(e) => {
                    last_error = format!("cannot resolve {addr}: {e}");
                    Vec::new()
                }
            };
            for candidate in &resolved {
                match TcpStream::connect_timeout(candidate, Duration::from_secs(2)) {
                    Ok(mut stream) => {
                        let _ = stream.set_nodelay(true);
                        let local_ip = stream
                            .local_addr()
                            .map_err(|e| store_error(addr, "connect", e.to_string()))?
                            .ip();
                        match auth::connect(
                            &mut stream,
                            job,
                            Service::Store,
                            role,
                            b"",
                            HANDSHAKE_DEADLINE,
                        ) {
                            Ok(_) => {}
                            Err(auth::Refusal::Busy) => {
                                last_error = "the store is busy with other connections".into();
                                continue;
                            }
                            Err(why) => {
                                return Err(store_error(addr, "connect", refusal(&why, job)));
                            }
                        }
                        return Ok(StoreClient {
                            addr: addr.to_string(),
                            stream: Mutex::new(stream),
                            local_ip,
                            broken: AtomicBool::new(false),
                        });
                    }
                    Err(e) => last_error = e.to_string(),
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(store_error(
                    addr,
                    "connect",
                    format!(
                        "no store answered within {} s ({last_error}); is rank 0 (or the \
                         launcher) running, and are MASTER_ADDR and MASTER_PORT right?",
                        timeout.as_secs_f64()
                    ),
                ));
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// The store's address, as given to [`connect`](Self::connect).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The local IP address of this connection: the address this host uses to reach the store.
    pub fn local_ip(&self) -> std::net::IpAddr {
        self.local_ip
    }

    fn request(&self, op_name: &str, request: &[u8], timeout: Duration) -> Result<(u8, Vec<u8>)> {
        if self.broken.load(Ordering::Relaxed) {
            return Err(store_error(
                &self.addr,
                op_name,
                "this connection failed earlier; reconnect".into(),
            ));
        }
        let fail = |e: io::Error| {
            self.broken.store(true, Ordering::Relaxed);
            let detail = match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    format!(
                        "no reply within {} s",
                        (timeout + REPLY_SLACK).as_secs_f64()
                    )
                }
                io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe => {
                    "the store closed the connection (its process ended?)".into()
                }
                _ => e.to_string(),
            };
            store_error(&self.addr, op_name, detail)
        };
        let mut stream = self
            .stream
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        stream
            .set_read_timeout(Some(timeout.saturating_add(REPLY_SLACK)))
            .map_err(fail)?;
        stream.write_all(request).map_err(fail)?;
        let status = read_u8(&mut *stream).map_err(fail)?;
        let mut body = Vec::new();
        match (request.first().copied(), status) {
            (_, STATUS_REFUSED) => {
                let why = read_bytes(&mut *stream, MAX_VALUE).map_err(fail)?;
                return Err(store_error(
                    &self.addr,
                    op_name,
                    format!("refused: {}", String::from_utf8_lossy(&why)),
                ));
            }
            (Some(OP_GET), STATUS_OK) | (Some(OP_WAIT), STATUS_TIMEOUT) => {
                body = read_bytes(&mut *stream, MAX_VALUE).map_err(fail)?;
            }
            (Some(OP_ADD), STATUS_OK) => {
                body = read_u64(&mut *stream).map_err(fail)?.to_le_bytes().to_vec();
            }
            (Some(OP_CHECK), STATUS_OK) => {
                let count = request
                    .get(1..5)
                    .map_or(0, |c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                body = vec![0u8; (count as usize).min(MAX_KEYS)];
                stream.read_exact(&mut body).map_err(fail)?;
            }
            _ => {}
        }
        Ok((status, body))
    }

    /// Sets `key` to `value`.
    ///
    /// # Errors
    /// [`DdpError::Store`] when the store cannot be reached.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        if value.len() > MAX_VALUE || key.len() > MAX_KEY {
            return Err(store_error(
                &self.addr,
                &format!("set `{key}`"),
                format!(
                    "keys are limited to {MAX_KEY} bytes and values to {MAX_VALUE}, got {} and {}",
                    key.len(),
                    value.len()
                ),
            ));
        }
        let mut request = vec![OP_SET];
        put_bytes(&mut request, key.as_bytes());
        put_bytes(&mut request, value);
        self.request(&format!("set `{key}`"), &request, Duration::ZERO)
            .map(drop)
    }

    /// The value of `key`, waiting up to `timeout` for some process to set it.
    ///
    /// # Errors
    /// [`DdpError::Store`] naming the key when it is not set within `timeout`, or the store
    /// cannot be reached.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let op = format!("get `{key}`");
        let deadline = Instant::now().checked_add(timeout);
        loop {
            // The store parks a request for at most MAX_WAIT: a longer wait asks again.
            let left = deadline.map_or(MAX_WAIT, |d| d.saturating_duration_since(Instant::now()));
            let mut request = vec![OP_GET];
            put_bytes(&mut request, key.as_bytes());
            request.extend_from_slice(&millis(left.min(MAX_WAIT)).to_le_bytes());
            match self.request(&op, &request, left.min(MAX_WAIT))? {
                (STATUS_OK, value) => return Ok(value),
                _ if left > MAX_WAIT => {}
                _ => {
                    return Err(store_error(
                        &self.addr,
                        &op,
                        format!("not set within {} s", timeout.as_secs_f64()),
                    ));
                }
            }
        }
    }

    /// Adds `delta` to the counter `key` (0 when unset) and returns the new value.
    ///
    /// # Errors
    /// [`DdpError::Store`] when the store cannot be reached.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut request = vec![OP_ADD];
        put_bytes(&mut request, key.as_bytes());
        request.extend_from_slice(&(delta as u64).to_le_bytes());
        let (_, body) = self.request(&format!("add `{key}`"), &request, Duration::ZERO)?;
        let word: [u8; 8] = body
            .get(..8)
            .and_then(|w| w.try_into().ok())
            .ok_or_else(|| {
                store_error(&self.addr, &format!("add `{key}`"), "a short reply".into())
            })?;
        Ok(u64::from_le_bytes(word) as i64)
    }

    /// Which of `keys` exist now (same order).
    ///
    /// # Errors
    /// [`DdpError::Store`] when the store cannot be reached.
    pub fn check(&self, keys: &[&str]) -> Result<Vec<bool>> {
        let mut request = vec![OP_CHECK];
        put_keys(&mut request, keys);
        let (_, body) = self.request("check", &request, Duration::ZERO)?;
        Ok(body.into_iter().map(|b| b != 0).collect())
    }

    /// Waits until every key of `keys` exists.
    ///
    /// # Errors
    /// [`DdpError::Store`] naming the keys still missing when `timeout` passes.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now().checked_add(timeout);
        let outcome = loop {
            // The store parks a request for at most MAX_WAIT: a longer wait asks again.
            let left = deadline.map_or(MAX_WAIT, |d| d.saturating_duration_since(Instant::now()));
            let mut request = vec![OP_WAIT];
            put_keys(&mut request, keys);
            request.extend_from_slice(&millis(left.min(MAX_WAIT)).to_le_bytes());
            match self.request("wait", &request, left.min(MAX_WAIT))? {
                (STATUS_TIMEOUT, _) if left > MAX_WAIT => {}
                outcome => break outcome,
            }
        };
        match outcome {
            (STATUS_OK, _) => Ok(()),
            (_, missing) => Err(store_error(
                &self.addr,
                "wait",
                format!(
                    "keys still missing after {} s: {}",
                    timeout.as_secs_f64(),
                    String::from_utf8_lossy(&missing).replace('\n', ", ")
                ),
            )),
        }
    }
}

fn millis(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> StoreServer {
        StoreServer::bind("127.0.0.1:0".parse().unwrap(), &crate::auth::test_job()).unwrap()
    }

    fn client(server: &StoreServer) -> StoreClient {
        StoreClient::connect(
            &server.local_addr().to_string(),
            Duration::from_secs(5),
            &crate::auth::test_job(),
            crate::auth::Role::Worker,
        )
        .unwrap()
    }

    #[test]
    fn the_store_binds_the_address_it_is_reached_at_unless_that_cannot_serve_the_job() {
        let bind = |host: &str, several_nodes| {
            bind_address(host, 29_500, several_nodes)
                .unwrap()
                .to_string()
        };
        // One node: loopback stays loopback (no other host can reach the store).
        assert_eq!(bind("127.0.0.1", false), "127.0.0.1:29500");
        assert_eq!(bind("[::1]", false), "[::1]:29500");
        // Several nodes reach a store whose own host name resolves to loopback by another name.
        assert_eq!(bind("127.0.0.1", true), "0.0.0.0:29500");
        assert_eq!(bind("::1", true), "[::]:29500");
        // An address of another host (TEST-NET-1): it cannot be bound here.
        assert_eq!(bind("192.0.2.1", false), "0.0.0.0:29500");
        assert!(bind_address("no-such-host.invalid", 29_500, false).is_err());
    }

    #[test]
    fn set_get_add_check_and_wait() {
        let server = server();
        let a = client(&server);
        let b = client(&server);
        a.set("x", b"hello").unwrap();
        assert_eq!(b.get("x", Duration::from_secs(1)).unwrap(), b"hello");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 3).unwrap(), 5);
        assert_eq!(b.get("n", Duration::from_secs(1)).unwrap(), b"5");
        assert_eq!(a.check(&["x", "y", "n"]).unwrap(), vec![true, false, true]);
        a.wait(&["x", "n"], Duration::from_secs(1)).unwrap();
    }

    #[test]
    fn get_waits_for_a_later_set() {
        let server = server();
        let addr = server.local_addr().to_string();
        let setter = thread::spawn(move || {
            let c = StoreClient::connect(
                &addr,
                Duration::from_secs(5),
                &crate::auth::test_job(),
                crate::auth::Role::Worker,
            )
            .unwrap();
            thread::sleep(Duration::from_millis(200));
            c.set("late", b"v").unwrap();
        });
        let value = client(&server)
            .get("late", Duration::from_secs(10))
            .unwrap();
        assert_eq!(value, b"v");
        setter.join().unwrap();
    }

    #[test]
    fn timeouts_name_the_key() {
        let server = server();
        let c = client(&server);
        let started = Instant::now();
        let err = c
            .get("never", Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("get `never`") && err.contains("not set within 0.3 s"),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        let err = c
            .wait(&["a", "b"], Duration::from_millis(100))
            .unwrap_err()
            .to_string();
        assert!(err.contains("a, b"), "{err}");
    }

    #[test]
    fn a_port_in_use_is_named() {
        let server = server();
        let err = StoreServer::bind(server.local_addr(), &crate::auth::test_job())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("already in use"), "{err}");
        assert!(
            err.contains(&server.local_addr().port().to_string()),
            "{err}"
        );
    }

    #[test]
    fn connecting_to_nothing_fails_within_the_timeout() {
        // Bind then drop to get a port nobody listens on.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let started = Instant::now();
        let err = StoreClient::connect(
            &format!("127.0.0.1:{port}"),
            Duration::from_millis(500),
            &crate::auth::test_job(),
            crate::auth::Role::Worker,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("no store answered within 0.5 s"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    fn connect_as(server: &StoreServer, job: &JobIdentity, role: Role) -> Result<StoreClient> {
        StoreClient::connect(
            &server.local_addr().to_string(),
            Duration::from_secs(2),
            job,
            role,
        )
    }

    #[test]
    fn strangers_and_other_runs_are_refused_and_the_job_goes_on() {
        let server = server();
        let member = client(&server);
        member.set("secret", b"value").unwrap();
        // Another token: refused, learns nothing.
        let stranger = JobIdentity::new("unit-tests", Some(b"guess")).unwrap();
        let err = connect_as(&server, &stranger, Role::Worker)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("authentication failed"), "{err}");
        // Another run: named, with both ids.
        let other = JobIdentity::new("job-b", Some(b"unit-test token")).unwrap();
        let err = connect_as(&server, &other, Role::Worker)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("belongs to run unit-tests") && err.contains("this process to run job-b"),
            "{err}"
        );
        // Raw bytes without the handshake: the server closes the connection, keeps serving.
        let mut raw = TcpStream::connect(server.local_addr()).unwrap();
        let _ = raw.write_all(&[OP_GET, 6, 0, 0, 0]);
        let _ = raw.write_all(b"secret");
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut seen = Vec::new();
        let _ = raw.read_to_end(&mut seen);
        assert!(!seen.windows(5).any(|w| w == b"value"), "the value leaked");
        assert_eq!(
            member.get("secret", Duration::from_secs(1)).unwrap(),
            b"value"
        );
    }

    #[test]
    fn only_launchers_write_the_launcher_keys() {
        let server = server();
        let worker = client(&server);
        let launcher = connect_as(&server, &crate::auth::test_job(), Role::Launcher).unwrap();
        let round = format!("{LAUNCHER_PREFIX}round");
        let err = worker.add(&round, 1).unwrap_err().to_string();
        assert!(err.contains("written by launchers only"), "{err}");
        assert!(worker.set(&round, b"7").is_err());
        assert_eq!(launcher.add(&round, 1).unwrap(), 1);
        // Workers read it, and members write the abort keys.
        assert_eq!(worker.add(&round, 0).unwrap(), 1);
        worker.set("burn-ddp/round-0/abort", b"why").unwrap();
    }

    #[test]
    fn sizes_are_bounded_and_a_non_store_service_is_named() {
        let server = server();
        let c = client(&server);
        let err = c
            .set("big", &vec![0u8; MAX_VALUE + 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("limited to"), "{err}");
        // A service that is not a store answers something else: named at once.
        let other = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = other.local_addr().unwrap();
        let serving = thread::spawn(move || {
            if let Ok((mut stream, _)) = other.accept() {
                let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
            }
        });
        let started = Instant::now();
        let err = StoreClient::connect(
            &addr.to_string(),
            Duration::from_secs(30),
            &crate::auth::test_job(),
            Role::Worker,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("not a burn-ddp rendezvous store"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
        serving.join().unwrap();
    }

    #[test]
    fn counters_count_against_the_table_and_the_table_bounds_its_keys() {
        let full = server();
        let c = client(&full);
        // Fill the table with values of halving size until not even one byte more fits.
        let mut size = MAX_VALUE;
        let mut n = 0;
        while size > 0 {
            if c.set(&format!("fill-{n}"), &vec![0u8; size]).is_err() {
                size /= 2;
            }
            n += 1;
        }
        // A new counter takes room too: refused, not added past the bound.
        let err = c.add("counter", 1).unwrap_err().to_string();
        assert!(err.contains("at most"), "{err}");
        // A table of tiny entries is bounded by its count of keys, and counts what each entry
        // costs beyond its bytes.
        let mut entries = Entries::default();
        for i in 0..MAX_ENTRIES {
            let key = i.to_string();
            entries.charge(&key, 1).unwrap();
            entries.map.insert(key, vec![1]);
        }
        let err = entries.charge("one more", 1).unwrap_err();
        assert!(err.contains("at most"), "{err}");
        assert!(entries.bytes >= MAX_ENTRIES * ENTRY_OVERHEAD);
        // Replacing a key's value costs no new key.
        entries.charge("0", 2).unwrap();
    }

    #[test]
    fn a_wait_without_end_from_a_client_that_left_frees_its_session() {
        let server = server();
        let c = client(&server);
        {
            // A member asks for a key nobody sets, with no end to the wait, and leaves.
            let mut request = vec![OP_GET];
            put_bytes(&mut request, b"never-set");
            request.extend_from_slice(&u64::MAX.to_le_bytes());
            let mut stream = c
                .stream
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            stream.write_all(&request).unwrap();
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        drop(c);
        let started = Instant::now();
        while server.sessions() > 0 && started.elapsed() < Duration::from_secs(10) {
            thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(server.sessions(), 0, "the parked session was not freed");
    }

    #[test]
    fn idle_connections_do_not_keep_the_job_out() {
        let server = server();
        // More idle connections than may be in their handshake at once.
        let idle: Vec<TcpStream> = (0..MAX_HANDSHAKES + 16)
            .filter_map(|_| TcpStream::connect(server.local_addr()).ok())
            .collect();
        let started = Instant::now();
        // Within the handshake deadline the slots free up and the job's process gets in.
        let c = StoreClient::connect(
            &server.local_addr().to_string(),
            Duration::from_secs(20),
            &crate::auth::test_job(),
            Role::Worker,
        );
        assert!(c.is_ok(), "{:?}", c.err());
        assert!(
            started.elapsed() < HANDSHAKE_DEADLINE * 3,
            "{:?}",
            started.elapsed()
        );
        drop(idle);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("BURN_DDP_FUZZ_CASES")
                .ok()
                .and_then(|c| c.parse().ok())
                .unwrap_or(24),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Random and truncated frames, before and after the handshake: the server neither
        /// panics nor allocates beyond its bounds, and keeps serving the job.
        #[test]
        fn random_frames_never_stop_the_store(
            before in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            after in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            op in 0u8..8,
            claimed_len in proptest::prelude::any::<u32>(),
        ) {
            let server = server();
            let member = client(&server);
            member.set("k", b"v").unwrap();
            // Garbage instead of a handshake.
            if let Ok(mut raw) = TcpStream::connect(server.local_addr()) {
                let _ = raw.write_all(&before);
            }
            // A member's session, then a frame with a random operation and claimed length.
            if let Ok(mut raw) = TcpStream::connect(server.local_addr()) {
                let job = crate::auth::test_job();
                if auth::connect(&mut raw, &job, Service::Store, Role::Worker, b"", HANDSHAKE_DEADLINE).is_ok() {
                    let mut frame = vec![op];
                    frame.extend_from_slice(&claimed_len.to_le_bytes());
                    frame.extend_from_slice(&after);
                    let _ = raw.write_all(&frame);
                }
            }
            proptest::prop_assert_eq!(member.get("k", Duration::from_secs(2)).unwrap(), b"v".to_vec());
            proptest::prop_assert!(client(&server).check(&["k"]).unwrap()[0]);
        }
    }
}
