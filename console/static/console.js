// The console's only script (its Content-Security-Policy allows no inline script or handler).
//
// A form with data-confirm asks before it is sent. One listener on the document, so a form
// swapped in by the live update below asks too.
document.addEventListener("submit", function (event) {
  var form = event.target;
  var question = form && form.dataset ? form.dataset.confirm : null;
  if (question && !window.confirm(question)) event.preventDefault();
});

// Live updates of a running session's page, without a reload and without a build step: while
// the session's tree still runs (data-active="true"), ask for its server-rendered live part
// every second and swap it in. The request names the part it has (If-None-Match): an unchanged
// session answers 304 and nothing is swapped. A swap keeps the keyboard focus where it was
// (the same button or link in the new part), so a keyboard user can still press Cancel. Stops
// once the tree is settled (one last swap shows the end).
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) return;
  var INTERVAL_MS = 1000;
  var etag = null;

  // A selector that finds the focused element again in the swapped-in part, or null.
  function focusKey(el) {
    if (!el || el === document.body || !live.contains(el)) return null;
    if (el.id) return "#" + CSS.escape(el.id);
    if (el.tagName === "A" && el.getAttribute("href")) return 'a[href="' + CSS.escape(el.getAttribute("href")) + '"]';
    return null;
  }

  function swap(html) {
    var key = focusKey(document.activeElement);
    live.innerHTML = html;
    if (key) {
      var again = live.querySelector(key);
      if (again) again.focus({ preventScroll: true });
    }
    var summary = live.querySelector(".summary");
    live.dataset.active = summary ? summary.dataset.active : "false";
  }

  function tick() {
    var headers = { Accept: "text/html" };
    if (etag) headers["If-None-Match"] = etag;
    fetch(live.dataset.src, { credentials: "same-origin", cache: "no-store", headers: headers })
      .then(function (r) {
        if (r.status === 304) return null;
        if (!r.ok) return Promise.reject(r.status);
        etag = r.headers.get("ETag");
        return r.text();
      })
      .then(function (html) {
        if (html !== null) {
          swap(html);
          live.dataset.swappedAt = String(Date.now());
        }
        live.dataset.updatedAt = String(Date.now());
        if (live.dataset.active === "true") setTimeout(tick, INTERVAL_MS);
      })
      .catch(function () { setTimeout(tick, INTERVAL_MS * 3); });
  }
  if (live.dataset.active === "true") setTimeout(tick, INTERVAL_MS);
})();
