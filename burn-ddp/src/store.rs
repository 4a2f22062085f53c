//! The rendezvous store: a small TCP key-value server, the counterpart of PyTorch's `TCPStore`.
//!
//! Rank 0 (or the launcher) serves it at `MASTER_ADDR:MASTER_PORT`; every process connects as a
//! client. Keys are strings, values bytes. Operations, each with a timeout:
//! - [`set`](StoreClient::set) a value;
//! - [`get`](StoreClient::get) a value, waiting until some process has set it;
//! - [`add`](StoreClient::add) to a counter (stored as decimal text) and read the new value;
//! - [`check`](StoreClient::check) which of some keys exist, without waiting;
//! - [`wait`](StoreClient::wait) until all of some keys exist.
//!
//! Wire format (all integers little-endian): a request is an operation byte followed by its
//! fields, a string or byte field being a `u32` length then the bytes; a reply is a status byte
//! (0 ok, 1 timeout) followed by the result.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::{DdpError, Result};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_WAIT: u8 = 5;

const STATUS_OK: u8 = 0;
const STATUS_TIMEOUT: u8 = 1;

/// Largest key or value accepted (64 MiB): protects the server from garbage on its port.
const MAX_FIELD: usize = 64 << 20;

#[derive(Default)]
struct Table {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.values
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits until every key exists or `timeout` passes; returns the missing keys.
    fn wait_for(&self, keys: &[String], timeout: Duration) -> Vec<String> {
        let deadline = Instant::now().checked_add(timeout);
        let mut values = self.lock();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !values.contains_key(*k))
                .cloned()
                .collect();
            let now = Instant::now();
            match deadline {
                _ if missing.is_empty() => return missing,
                Some(deadline) if now >= deadline => return missing,
                Some(deadline) => {
                    values = self
                        .changed
                        .wait_timeout(values, deadline - now)
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .0;
                }
                None => {
                    values = self
                        .changed
                        .wait(values)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
            }
        }
    }
}

/// The store server. Accepts clients until dropped; connected clients are served until they
/// disconnect.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<thread::JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on `addr` (e.g. `0.0.0.0:29500`; port 0 picks a free port, see
    /// [`local_addr`](Self::local_addr)) and serves clients on background threads.
    ///
    /// # Errors
    /// [`DdpError::Store`] when the port is already in use or cannot be bound.
    pub fn bind(addr: SocketAddr) -> Result<StoreServer> {
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
        let table = Arc::new(Table::default());
        let accept_stop = stop.clone();
        let accept = thread::Builder::new()
            .name("burn-ddp-store".into())
            .spawn(move || accept_loop(listener, table, accept_stop))
            .map_err(|e| store_error(&addr.to_string(), "bind", e.to_string()))?;
        tracing::debug!("burn-ddp: store serving on {local}");
        Ok(StoreServer {
            addr: local,
            stop,
            accept: Some(accept),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
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

fn accept_loop(listener: TcpListener, table: Arc<Table>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let table = table.clone();
                let _ = thread::Builder::new()
                    .name("burn-ddp-store-client".into())
                    .spawn(move || serve(stream, &table));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(20));
            }
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Serves one client until it disconnects. Dropping the [`StoreServer`] only stops accepting new
/// clients: connected ones keep being served, so the process serving the store may finish its
/// own rendezvous before the others have read the last keys.
fn serve(mut stream: TcpStream, table: &Table) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    while serve_one(&mut stream, table).is_ok() {}
}

fn serve_one(stream: &mut TcpStream, table: &Table) -> io::Result<()> {
    let op = read_u8(stream)?;
    let mut reply = Vec::new();
    match op {
        OP_SET => {
            let key = read_string(stream)?;
            let value = read_bytes(stream)?;
            table.lock().insert(key, value);
            table.changed.notify_all();
            reply.push(STATUS_OK);
        }
        OP_GET => {
            let key = read_string(stream)?;
            let timeout = Duration::from_millis(read_u64(stream)?);
            if table
                .wait_for(std::slice::from_ref(&key), timeout)
                .is_empty()
            {
                let value = table.lock().get(&key).cloned().unwrap_or_default();
                reply.push(STATUS_OK);
                put_bytes(&mut reply, &value);
            } else {
                reply.push(STATUS_TIMEOUT);
            }
        }
        OP_ADD => {
            let key = read_string(stream)?;
            let delta = read_u64(stream)? as i64;
            let mut values = table.lock();
            let current = values
                .get(&key)
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                .unwrap_or(0);
            let next = current.wrapping_add(delta);
            values.insert(key, next.to_string().into_bytes());
            drop(values);
            table.changed.notify_all();
            reply.push(STATUS_OK);
            reply.extend_from_slice(&(next as u64).to_le_bytes());
        }
        OP_CHECK => {
            let keys = read_keys(stream)?;
            let values = table.lock();
            reply.push(STATUS_OK);
            reply.extend(keys.iter().map(|k| u8::from(values.contains_key(k))));
        }
        OP_WAIT => {
            let keys = read_keys(stream)?;
            let timeout = Duration::from_millis(read_u64(stream)?);
            let missing = table.wait_for(&keys, timeout);
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

fn read_bytes(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FIELD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "field too large",
        ));
    }
    let mut value = vec![0u8; len];
    r.read_exact(&mut value)?;
    Ok(value)
}

fn read_string(r: &mut impl Read) -> io::Result<String> {
    String::from_utf8(read_bytes(r)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))
}

fn read_keys(r: &mut impl Read) -> io::Result<Vec<String>> {
    let mut count = [0u8; 4];
    r.read_exact(&mut count)?;
    (0..u32::from_le_bytes(count))
        .map(|_| read_string(r))
        .collect()
}

/// Appends a length-prefixed field. Callers keep fields under [`MAX_FIELD`] (checked in
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
    /// Connects to the store at `addr` (`host:port`), retrying until `timeout` passes, since the
    /// server may start after the clients.
    ///
    /// # Errors
    /// [`DdpError::Store`] when no store answers at `addr` within `timeout`, or `addr` does not
    /// resolve.
    pub fn connect(addr: &str, timeout: Duration) -> Result<StoreClient> {
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
                    Ok(stream) => {
                        let _ = stream.set_nodelay(true);
                        let local_ip = stream
                            .local_addr()
                            .map_err(|e| store_error(addr, "connect", e.to_string()))?
                            .ip();
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
        match (request[0], status) {
            (OP_GET, STATUS_OK) | (OP_WAIT, STATUS_TIMEOUT) => {
                body = read_bytes(&mut *stream).map_err(fail)?;
            }
            (OP_ADD, STATUS_OK) => {
                body = read_u64(&mut *stream).map_err(fail)?.to_le_bytes().to_vec();
            }
            (OP_CHECK, STATUS_OK) => {
                let count = u32::from_le_bytes([request[1], request[2], request[3], request[4]]);
                body = vec![0u8; count as usize];
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
        if value.len() > MAX_FIELD || key.len() > MAX_FIELD {
            return Err(store_error(
                &self.addr,
                &format!("set `{key}`"),
                format!(
                    "values are limited to {MAX_FIELD} bytes, got {}",
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
        let mut request = vec![OP_GET];
        put_bytes(&mut request, key.as_bytes());
        request.extend_from_slice(&millis(timeout).to_le_bytes());
        let op = format!("get `{key}`");
        match self.request(&op, &request, timeout)? {
            (STATUS_OK, value) => Ok(value),
            _ => Err(store_error(
                &self.addr,
                &op,
                format!("not set within {} s", timeout.as_secs_f64()),
            )),
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
        let mut word = [0u8; 8];
        word.copy_from_slice(&body[..8]);
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
        let mut request = vec![OP_WAIT];
        put_keys(&mut request, keys);
        request.extend_from_slice(&millis(timeout).to_le_bytes());
        match self.request("wait", &request, timeout)? {
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
        StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap()
    }

    fn client(server: &StoreServer) -> StoreClient {
        StoreClient::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap()
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
            let c = StoreClient::connect(&addr, Duration::from_secs(5)).unwrap();
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
        let err = StoreServer::bind(server.local_addr())
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
        let err = StoreClient::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(500))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no store answered within 0.5 s"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
