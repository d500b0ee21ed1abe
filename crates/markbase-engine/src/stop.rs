//! Stop strings in streamed text: text is released only once it cannot be the start of a stop
//! string, so a stop string never reaches the caller, even when it arrives split over tokens.

/// Filters a stream of text chunks against a set of stop strings.
#[derive(Debug, Default)]
pub struct StopFilter {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

impl StopFilter {
    /// A filter for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        StopFilter {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has been seen.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds `text` and returns what can safely be released. After a stop string is found, the
    /// text before it is returned, [`StopFilter::stopped`] becomes true and later input is ignored.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.pending.push_str(text);
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first_stop {
            self.stopped = true;
            self.pending.truncate(at);
            return std::mem::take(&mut self.pending);
        }
        let keep_from = self.holdback_start();
        let rest = self.pending.split_off(keep_from);
        std::mem::replace(&mut self.pending, rest)
    }

    /// Releases whatever is held back (at the end of generation).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.pending)
    }

    /// Start of the longest suffix of `pending` that is a proper prefix of some stop string.
    fn holdback_start(&self) -> usize {
        let p = &self.pending;
        p.char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let suffix = &p[i..];
                self.stops.iter().any(|s| s.starts_with(suffix))
            })
            .unwrap_or(p.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (Vec<String>, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut f = StopFilter::new(&stops);
        let mut out: Vec<String> = chunks.iter().map(|c| f.push(c)).collect();
        out.push(f.finish());
        (out, f.stopped())
    }

    #[test]
    fn no_stops_passes_everything_through() {
        let (out, stopped) = run(&[], &["a", "b c"]);
        assert_eq!(out, ["a", "b c", ""]);
        assert!(!stopped);
    }

    #[test]
    fn stop_split_across_chunks_never_leaks() {
        let (out, stopped) = run(&["</end>"], &["Hello </", "en", "d> more"]);
        assert_eq!(out.concat(), "Hello ");
        assert_eq!(out[0], "Hello ");
        assert_eq!(out[1], "");
        assert!(stopped);
    }

    #[test]
    fn false_prefix_is_released_once_disproved() {
        let (out, stopped) = run(&["STOP"], &["a ST", "x", "y"]);
        assert_eq!(out, ["a ", "STx", "y", ""]);
        assert!(!stopped);
        // Held back at the end but never completed: released by finish.
        let (out, _) = run(&["STOP"], &["a ST"]);
        assert_eq!(out, ["a ", "ST"]);
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (out, stopped) = run(&["bb", "a"], &["xxbbya"]);
        assert_eq!(out.concat(), "xx");
        assert!(stopped);
        let (out, _) = run(&["\n\n", "User:"], &["one\n", "two User:", " three"]);
        assert_eq!(out.concat(), "one\ntwo ");
    }

    #[test]
    fn input_after_stop_is_ignored() {
        let stops = vec!["x".to_string()];
        let mut f = StopFilter::new(&stops);
        assert_eq!(f.push("axb"), "a");
        assert_eq!(f.push("c"), "");
        assert_eq!(f.finish(), "");
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let (out, stopped) = run(&["é!"], &["café", "!", "x"]);
        assert_eq!(out.concat(), "caf");
        assert_eq!(out[0], "caf");
        assert!(stopped);
    }
}
