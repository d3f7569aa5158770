//! Who may join a run: every store and mesh connection starts with a mutual HMAC-SHA256
//! challenge–response over the run's shared token, before anything else is served.
//!
//! The token comes from `ACCEL_TOKEN` (`accel launch` sets a fresh random one per launch),
//! or from the file `ACCEL_TOKEN_FILE` names (for torchrun, Slurm or MPI starts: any shared
//! secret, e.g. `head -c 32 /dev/urandom | base64 > token` on a shared disk). Without one,
//! connections are not authenticated (and a warning says so once when several machines
//! take part). What this protects: a process without the token cannot claim a rank, set
//! or read keys, or feed data into collectives, and cannot pose as the store or a peer.
//! What it does not: traffic is authenticated, not encrypted; a process running as the
//! same user can read the token from the environment of the ranks.
//!
//! The exchange (dialler A, acceptor B; nonces of 16 random bytes):
//! A → B: `mode`, nonce_a; B → A: `mode`, nonce_b, HMAC(k, "accel-acceptor" ‖ ctx ‖ nonce_a ‖ nonce_b);
//! A → B: HMAC(k, "accel-dialler" ‖ ctx ‖ nonce_a ‖ nonce_b). `mode` 1 = with a token, 0 = without; a
//! mismatch is a named error on both sides. `ctx` names the channel (store, mesh), so that a
//! proof from one cannot be replayed on the other.

use std::io::{Read, Write};
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

const NONCE: usize = 16;
const PROOF: usize = 32;

/// The run's shared secret (`None`: connections are not authenticated).
#[derive(Clone, Default)]
pub struct Token(Option<Vec<u8>>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Token(set)" } else { "Token(none)" })
    }
}

/// Where the token is looked for.
pub const TOKEN_ENV: &str = crate::config::env::TOKEN;
/// A file holding the token.
pub const TOKEN_FILE_ENV: &str = crate::config::env::TOKEN_FILE;

impl Token {
    /// No authentication.
    pub fn none() -> Self {
        Self(None)
    }

    /// A token of these bytes (at least 16).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() < 16 {
            return Err(Error::Config(format!(
                "the run's token has {} bytes; use at least 16 random bytes",
                bytes.len()
            )));
        }
        Ok(Self(Some(bytes.to_vec())))
    }

    /// A fresh random token, as text (what `accel launch` hands its processes).
    pub fn generate() -> Result<String> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes)
            .map_err(|e| Error::Config(format!("no random numbers for the run's token: {e}")))?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// `ACCEL_TOKEN`, else the file `ACCEL_TOKEN_FILE` names, else none.
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(|k| std::env::var(k).ok())
    }

    /// [`Token::from_env`] through `get`.
    pub fn from_env_with(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        if let Some(text) = get(TOKEN_ENV).filter(|t| !t.trim().is_empty()) {
            return Self::from_bytes(text.trim().as_bytes()).map_err(|e| prefixed(TOKEN_ENV, e));
        }
        if let Some(path) = get(TOKEN_FILE_ENV) {
            let path = Path::new(&path);
            let text = std::fs::read(path)
                .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
            let trimmed = String::from_utf8_lossy(&text).trim().as_bytes().to_vec();
            let what = format!("{TOKEN_FILE_ENV} {}", path.display());
            return Self::from_bytes(&trimmed).map_err(|e| prefixed(&what, e));
        }
        Ok(Self::none())
    }

    /// Whether connections are authenticated.
    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    fn mac(&self, role: &str, context: &str, a: &[u8], b: &[u8]) -> HmacSha256 {
        let key = self.0.as_deref().unwrap_or_default();
        let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
        // Each part length-prefixed, so that no two different inputs read alike.
        for part in [role.as_bytes(), context.as_bytes(), a, b] {
            mac.update(&(part.len() as u32).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    fn proof(&self, role: &str, context: &str, a: &[u8], b: &[u8]) -> [u8; PROOF] {
        self.mac(role, context, a, b).finalize().into_bytes().into()
    }

    /// Compares in constant time.
    fn check(&self, role: &str, context: &str, a: &[u8], b: &[u8], got: &[u8]) -> bool {
        self.mac(role, context, a, b).verify_slice(got).is_ok()
    }

    fn mode(&self) -> u8 {
        u8::from(self.is_set())
    }
}

fn prefixed(what: &str, e: Error) -> Error {
    match e {
        Error::Config(m) => Error::Config(format!("{what}: {m}")),
        other => other,
    }
}

fn nonce() -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| Error::Rendezvous(format!("no random numbers: {e}")))?;
    Ok(n)
}

fn mode_mismatch(context: &str, mine: u8) -> Error {
    let (we, they) = if mine == 1 { ("has a", "has none") } else { ("has no", "has one") };
    Error::Rendezvous(format!(
        "{context}: this process {we} token ({TOKEN_ENV} / {TOKEN_FILE_ENV}) and the other side \
         {they}; every process of a run must get the same token"
    ))
}

fn io(context: &str, e: std::io::Error) -> Error {
    Error::Rendezvous(format!("{context}: authentication failed: {e}"))
}

/// Why a dialler's handshake did not complete.
#[derive(Debug)]
pub enum DialFailure {
    /// The connection closed or failed before the exchange ended (a server at its connection
    /// limit, a restart): worth dialling again.
    Dropped(Error),
    /// The other side answered and the answer is wrong: dialling again cannot help.
    Refused(Error),
}

/// The dialling side's half: proves the token to the acceptor and checks the acceptor's
/// proof. Nothing else may be sent on `stream` before it returns.
pub fn authenticate_dialler(
    stream: &mut (impl Read + Write),
    token: &Token,
    context: &str,
) -> Result<()> {
    try_authenticate_dialler(stream, token, context).map_err(|f| match f {
        DialFailure::Dropped(e) | DialFailure::Refused(e) => e,
    })
}

/// [`authenticate_dialler`], telling a dropped connection from a refusal.
pub fn try_authenticate_dialler(
    stream: &mut (impl Read + Write),
    token: &Token,
    context: &str,
) -> std::result::Result<(), DialFailure> {
    let dropped = |e| DialFailure::Dropped(io(context, e));
    let a = nonce().map_err(DialFailure::Refused)?;
    let mut hello = vec![token.mode()];
    hello.extend_from_slice(&a);
    stream.write_all(&hello).map_err(dropped)?;
    let mut mode = [0u8; 1];
    stream.read_exact(&mut mode).map_err(dropped)?;
    if mode[0] != token.mode() {
        return Err(DialFailure::Refused(mode_mismatch(context, token.mode())));
    }
    if !token.is_set() {
        return Ok(());
    }
    let mut reply = [0u8; NONCE + PROOF];
    stream.read_exact(&mut reply).map_err(dropped)?;
    let (b, theirs) = reply.split_at(NONCE);
    if !token.check("accel-acceptor", context, &a, b, theirs) {
        return Err(DialFailure::Refused(Error::Rendezvous(format!(
            "{context}: the other side does not hold this run's token (a process of another run, \
             or not accel at all, answered at this address)"
        ))));
    }
    let proof = token.proof("accel-dialler", context, &a, b);
    stream.write_all(&proof).map_err(dropped)
}

/// The accepting side's half: checks the dialler's proof and proves the token in turn.
/// Returns an error (and the caller drops the connection) for anyone without the token.
pub fn authenticate_acceptor(
    stream: &mut (impl Read + Write),
    token: &Token,
    context: &str,
) -> Result<()> {
    let mut hello = [0u8; 1 + NONCE];
    stream.read_exact(&mut hello).map_err(|e| io(context, e))?;
    stream.write_all(&[token.mode()]).map_err(|e| io(context, e))?;
    if hello[0] != token.mode() {
        return Err(mode_mismatch(context, token.mode()));
    }
    if !token.is_set() {
        return Ok(());
    }
    let a = &hello[1..];
    let b = nonce()?;
    let mut reply = b.to_vec();
    reply.extend_from_slice(&token.proof("accel-acceptor", context, a, &b));
    stream.write_all(&reply).map_err(|e| io(context, e))?;
    let mut theirs = [0u8; PROOF];
    stream.read_exact(&mut theirs).map_err(|e| io(context, e))?;
    if !token.check("accel-dialler", context, a, &b, &theirs) {
        return Err(Error::Rendezvous(format!(
            "{context}: a connection without this run's token was refused"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn pair(dialler: Token, acceptor: Token) -> (Result<()>, Result<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            authenticate_acceptor(&mut s, &acceptor, "test")
        });
        let mut s = TcpStream::connect(addr).unwrap();
        let dialled = authenticate_dialler(&mut s, &dialler, "test");
        drop(s);
        (dialled, accept.join().unwrap())
    }

    #[test]
    fn only_holders_of_the_same_token_get_through_both_ways() {
        let t = |s: &str| Token::from_bytes(s.as_bytes()).unwrap();
        let (a, b) = pair(t("0123456789abcdef-one"), t("0123456789abcdef-one"));
        assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
        let (a, b) = pair(t("0123456789abcdef-one"), t("0123456789abcdef-two"));
        assert!(a.unwrap_err().to_string().contains("does not hold this run's token"));
        assert!(b.is_err());
        let (a, b) = pair(Token::none(), t("0123456789abcdef-one"));
        assert!(a.unwrap_err().to_string().contains("has no token"));
        assert!(b.unwrap_err().to_string().contains("has a token"));
        let (a, b) = pair(Token::none(), Token::none());
        assert!(a.is_ok() && b.is_ok());
    }

    #[test]
    fn tokens_come_from_the_environment_or_a_file_and_must_be_long_enough() {
        let generated = Token::generate().unwrap();
        assert_eq!(generated.len(), 64);
        assert_ne!(generated, Token::generate().unwrap());
        let env = |k: &str| (k == TOKEN_ENV).then(|| generated.clone());
        assert!(Token::from_env_with(env).unwrap().is_set());
        let short = |k: &str| (k == TOKEN_ENV).then(|| "short".to_owned());
        assert!(Token::from_env_with(short).unwrap_err().to_string().contains("at least 16"));
        assert!(!Token::from_env_with(|_| None).unwrap().is_set());
    }
}
